"""The coordinator's engine: applies ``policy`` decisions to ``state`` and persists them first.

One ``CoordinatorCore`` lives in the server's event loop; every method runs on that loop, so no
locks are needed. Each change follows the same order: decide, write to SQLite in one transaction,
apply in memory, then wake whoever waits (barrier waiters, KV waiters, round waiters, watch
streams). If the write fails the in-memory state is untouched and the request fails.

No protobuf here: the gRPC servicer (``service``) validates and converts messages. Time comes
from an injected ``clock`` so tests can drive leases and deadlines without sleeping.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable

from elasticrl.coordinator import policy
from elasticrl.coordinator.barriers import BarrierOps
from elasticrl.coordinator.kv import KeyValueOps
from elasticrl.coordinator.metrics import Metrics
from elasticrl.coordinator.persist import StateDB
from elasticrl.coordinator.replies import DEFAULT_KEEP, Replies
from elasticrl.coordinator.signals import Signals
from elasticrl.coordinator.state import (
    Member,
    MemberStatus,
    Rendezvous,
    RoundConfig,
    RoundResult,
    Run,
    copy_rendezvous,
)
from elasticrl.errors import (
    FencedError,
    InvalidRequestError,
    NotFoundError,
    ResourceLimitError,
    RunClosedError,
    StaleEpochError,
)

log = logging.getLogger(__name__)

DEFAULT_STREAM_GRACE_S = 0.5
"""How long a member whose stream broke has to reopen one before it is evicted (``--stream-grace``)."""


@dataclasses.dataclass(kw_only=True)
class Limits:
    """Per-run ceilings that keep one misbehaving client from exhausting the coordinator."""

    max_members_per_run: int = 10_000
    """Members (live or departed) one run may hold."""
    max_kv_bytes_per_run: int = 256 << 20
    """Sum of key and value sizes stored for one run, bytes."""
    max_barriers_per_run: int = 1_000_000
    """Open barriers one run may hold."""
    keep_decided_barriers: int = 1000
    """Decided barriers kept per run (a late retry of an arrival gets the result again); older
    ones are dropped, oldest decision first. A member that far behind was evicted long ago."""
    max_runs: int = 1000
    """Runs one coordinator holds; at the limit, a new run id replaces the oldest closed run
    with no live member, or is refused (``--max-runs``)."""


@dataclasses.dataclass(frozen=True)
class Event:
    """A membership or round change, as a watch stream reports it."""

    kind: str  # "joined", "left", "evicted", "round", "closed"
    member: Member | None
    epoch: int
    reason: str


class Watcher:
    """A watch stream's mailbox: events since the last read, and a flag the stream awaits."""

    MAX_EVENTS = 1000

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.dirty = asyncio.Event()

    def push(self, event: Event) -> None:
        self.events.append(event)
        if len(self.events) > self.MAX_EVENTS:  # a slow reader still gets a correct snapshot
            del self.events[: len(self.events) - self.MAX_EVENTS]
        self.dirty.set()

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        self.dirty.clear()
        return events


class CoordinatorCore(BarrierOps, KeyValueOps):
    def __init__(
        self,
        db: StateDB,
        *,
        lease_ttl_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        limits: Limits | None = None,
        metrics: Metrics | None = None,
        keep_request_ids: int = DEFAULT_KEEP,
        stream_grace_s: float = DEFAULT_STREAM_GRACE_S,
    ):
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        if stream_grace_s < 0:
            raise ValueError(f"stream_grace_s must be >= 0, got {stream_grace_s}")
        self.stream_grace_s = stream_grace_s
        # Liveness by stream: (run, member, incarnation) -> open streams that carry its keep-alives
        # or its work, and -> when the last of them broke (it is evicted unless one reopens within
        # stream_grace_s). A process the kernel killed has its sockets closed at once; a silent
        # host (power loss, partition) closes nothing and is left to its lease.
        self._streams: collections.Counter[tuple[str, str, int]] = collections.Counter()
        self._stream_lost: dict[tuple[str, str, int], float] = {}
        self.db = db
        self.lease_ttl_s = lease_ttl_s
        self.clock = clock
        self.limits = limits or Limits()
        self.started_at = clock()
        # Counted into whether or not an endpoint serves it (a few dict updates per decision).
        self.metrics = metrics if metrics is not None else Metrics(clock)
        self.runs: dict[str, Run] = db.load(clock())
        self.replies = Replies(db.connection, keep=keep_request_ids)
        # Wake-ups of waiting arrivals (by (run, barrier)), KV waits and round joins (by run).
        self._barrier_signals = Signals()
        self._not_arrived: dict[tuple[str, str], set[str]] = {}
        self._together: list = []  # arrive_together's calls of this turn of the event loop
        self._kv_signals = Signals()
        self._round_signals = Signals()
        self._watchers: dict[str, set[Watcher]] = {}
        # Called as fn(run_id, member) right after a member stops being live (left, evicted or
        # replaced): the scheduler requeues that member's tasks.
        self.gone_listeners: list[Callable[[str, Member], None]] = []
        # Called as fn(run_id) after a run was dropped to make room (``Limits.max_runs``): the
        # scheduler forgets its iterations. SQLite rows of the run are gone already.
        self.run_dropped_listeners: list[Callable[[str], None]] = []
        self.run_closed_listeners: list[Callable[[str, str], None]] = []  # fn(run_id, reason): no new work comes
        for run in self.runs.values():  # a crash between a barrier's last arrival and its decision:
            for barrier in list(run.open_barriers.values()):  # retried arrivals change nothing, so decide now
                self._decide_barrier(run, barrier)
        if self.runs:
            live = sum(len(r.live_members()) for r in self.runs.values())
            log.info(
                "loaded %d run(s) with %d live member(s) from %s; each has %.1fs to reconnect",
                len(self.runs), live, db.path, lease_ttl_s,
            )

    # -- lookups and fencing -----------------------------------------------------------------

    def _run(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise NotFoundError(f"run_id: no run named {run_id!r} on this coordinator (join it first)")
        return run

    def run_or_new(self, run_id: str) -> Run:
        """The run ``run_id``, made (in memory, counted against ``max_runs``) if it is new; the
        caller's next write persists it."""
        return self._run_or_new(run_id)

    def _run_or_new(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            if len(self.runs) >= self.limits.max_runs:
                self._drop_a_finished_run(run_id)
            run = self.runs[run_id] = Run(run_id=run_id)
        return run

    def _drop_a_finished_run(self, for_run: str) -> None:
        """Make room for ``for_run``: forget the oldest closed run with no live member (its
        members, keys, barriers and rounds; the scheduler its iterations), or refuse."""
        finished = next((r for r in self.runs.values() if r.closed and r.live_count == 0), None)
        if finished is None:
            raise ResourceLimitError(
                f"run_id: {for_run!r} would be run number {len(self.runs) + 1} on this coordinator "
                f"(limit {self.limits.max_runs}, --max-runs) and no closed run can make room; close "
                "finished runs (elasticrl close-run) or raise --max-runs"
            )
        with self.db.tx() as db:
            db.delete_run(finished.run_id)
        del self.runs[finished.run_id]
        self.metrics.forget_run(finished.run_id)
        log.info("dropped closed run %s to make room for run %s (--max-runs %d)", finished.run_id, for_run, self.limits.max_runs)
        for listener in self.run_dropped_listeners:
            try:
                listener(finished.run_id)
            except Exception:  # noqa: BLE001 - the run is gone from SQLite already; log and go on
                log.exception("run-dropped listener %r failed for %s", listener, finished.run_id)

    def _fence(self, run: Run, member_id: str, incarnation: int, epoch: int = 0) -> Member:
        m = run.members.get(member_id)
        if m is None:
            raise NotFoundError(f"member.member_id: {member_id!r} never joined run {run.run_id!r}")
        if incarnation != m.incarnation:
            raise FencedError(
                f"member {member_id!r} incarnation {incarnation} is stale: incarnation "
                f"{m.incarnation} replaced it; join again"
            )
        if not m.live:
            raise FencedError(
                f"member {member_id!r} incarnation {incarnation} is no longer live "
                f"({m.status.value}: {m.reason}); join again"
            )
        if epoch and epoch < m.joined_epoch:
            raise StaleEpochError(
                f"epoch: {epoch} predates this incarnation's join at epoch {m.joined_epoch} "
                f"(run epoch is {run.epoch})"
            )
        if epoch > run.epoch:
            raise InvalidRequestError(f"epoch: {epoch} is from the future (run epoch is {run.epoch})")
        return m

    # -- membership --------------------------------------------------------------------------

    def join(
        self,
        run_id: str,
        member_id: str,
        *,
        host: str = "",
        weight: float = 1.0,
        capabilities: dict[str, str] | None = None,
        lease_ttl_s: float = 0.0,
        request_id: str = "",
    ) -> tuple[Member, int]:
        """Admit a new incarnation of ``member_id``; a previous live one is evicted (fenced).
        A retried join (same ``request_id``) gets the incarnation its first attempt created."""
        done = self.replies.get(request_id, "join")
        if done is not None:
            return self._joined(run_id, member_id, done), done["epoch"]
        run = self._run_or_new(run_id)
        if run.closed:
            raise RunClosedError(f"run {run_id!r} is closed ({run.close_reason}); start a new run id")
        old = run.members.get(member_id)
        if old is None and len(run.members) >= self.limits.max_members_per_run:
            raise ResourceLimitError(
                f"run {run_id!r} already holds {len(run.members)} members "
                f"(limit {self.limits.max_members_per_run})"
            )
        now = self.clock()
        ttl = lease_ttl_s or self.lease_ttl_s
        replaced = old is not None and old.live
        epoch = run.epoch + 1 + int(replaced)
        with self.db.tx() as db:
            incarnation = db.next_incarnation()
            member = Member(
                member_id=member_id,
                incarnation=incarnation,
                host=host,
                weight=weight,
                capabilities=dict(capabilities or {}),
                joined_epoch=epoch,
                lease_ttl_s=ttl,
                lease_deadline=now + ttl,
            )
            db.put_run(run, epoch=epoch)
            db.put_member(run_id, member)
            reply = {"incarnation": incarnation, "epoch": epoch, "ttl": ttl}
            self.replies.record(request_id, "join", reply)
        self.replies.remember(request_id)
        if replaced:
            self._mark_gone(run, old, MemberStatus.EVICTED, f"replaced by incarnation {incarnation}")
            self.metrics.evictions.inc(run=run_id, reason="replaced")
        run.epoch = epoch
        run.members[member_id] = member
        run.live_count += 1
        run.lease_floor = min(run.lease_floor, member.lease_deadline)
        self.metrics.joins.inc(run=run_id)
        log.info(
            "run %s: member %s joined (incarnation %d, host %s, weight %g) -> epoch %d, %d live",
            run_id, member_id, incarnation, host or "?", weight, epoch, run.live_count,
        )
        self._emit(run, Event("joined", member, epoch, ""))
        if member_id in run.rendezvous.timed_out:
            # The report was its previous incarnation's (a round it waited in timed out with no
            # call to tell): a new agent process keeping the node id (``--rdzv-conf node_id``)
            # must not fail at its first round for it.
            pending = copy_rendezvous(run.rendezvous)
            del pending.timed_out[member_id]
            self._commit_rendezvous(run, pending)
        self._after_membership_change(run)
        return member, epoch

    def _joined(self, run_id: str, member_id: str, reply: dict) -> Member:
        """The member a stored join created: itself while it is current, else its record as it was
        (its calls will be fenced, as they would have been without the retry)."""
        run = self.runs.get(run_id)
        m = run.members.get(member_id) if run is not None else None
        if m is not None and m.incarnation == reply["incarnation"]:
            return m
        return Member(
            member_id=member_id, incarnation=reply["incarnation"], host="", weight=1.0, capabilities={},
            joined_epoch=reply["epoch"], lease_ttl_s=reply["ttl"], lease_deadline=0.0,
            status=MemberStatus.EVICTED, reason="replaced by a newer incarnation",
        )

    def check_member(self, run_id: str, member_id: str, incarnation: int) -> Member:
        """The live member ``member_id`` with exactly ``incarnation``, else NotFound/Fenced."""
        return self._fence(self._run(run_id), member_id, incarnation)

    def keep_alive(self, run_id: str, member_id: str, incarnation: int) -> tuple[int, float]:
        run = self._run(run_id)
        m = self._fence(run, member_id, incarnation)
        m.lease_deadline = self.clock() + m.lease_ttl_s  # leases are not persisted: see persist.load
        return run.epoch, m.lease_ttl_s

    def leave(self, run_id: str, member_id: str, incarnation: int, reason: str = "", *, request_id: str = "") -> int:
        done = self.replies.get(request_id, "leave")
        if done is not None:
            return done["epoch"]
        run = self._run(run_id)
        m = self._fence(run, member_id, incarnation)
        self._remove(run, m, MemberStatus.LEFT, reason or "left", reply=(request_id, "leave"))
        self.metrics.leaves.inc(run=run_id)
        return run.epoch

    def _remove(
        self, run: Run, m: Member, status: MemberStatus, reason: str, *, reply: tuple[str, str] = ("", ""),
    ) -> None:
        """Evict or retire a live member: persist, bump the epoch, then release whatever it blocked
        (every open barrier and the pending round are decided again, whatever the cause).
        ``reply``: (request id, kind) of the call whose retries get the new epoch back."""
        with self.db.tx() as db:
            db.put_member(run.run_id, m, status=status, reason=reason)
            db.put_run(run, epoch=run.epoch + 1)
            self.replies.record(*reply, {"epoch": run.epoch + 1})
        self.replies.remember(reply[0])
        run.epoch += 1
        self._mark_gone(run, m, status, reason)
        self._after_membership_change(run)

    def _mark_gone(self, run: Run, m: Member, status: MemberStatus, reason: str) -> None:
        if m.live:
            run.live_count -= 1
        m.status, m.reason = status, reason
        log.info(
            "run %s: member %s (incarnation %d) %s: %s -> epoch %d, %d live",
            run.run_id, m.member_id, m.incarnation, status.value, reason, run.epoch, run.live_count,
        )
        kind = "left" if status is MemberStatus.LEFT else "evicted"
        self._emit(run, Event(kind, m, run.epoch, reason))
        for listener in self.gone_listeners:
            try:
                listener(run.run_id, m)
            except Exception:  # noqa: BLE001 - a listener's bug must not undo a membership change
                log.exception("member-gone listener %r failed for %s/%s", listener, run.run_id, m.member_id)

    def _after_membership_change(self, run: Run) -> None:
        for barrier in list(run.open_barriers.values()):
            self._decide_barrier(run, barrier)
        rdzv = run.rendezvous
        stale = [mid for mid, inc in rdzv.waiting.items() if not run.is_live(mid, inc)]
        pending = None
        if stale:
            pending = copy_rendezvous(rdzv)
            for mid in stale:
                del pending.waiting[mid]
        self._decide_round(run, pending)
        self._notify_round(run.run_id)

    # -- liveness by stream -------------------------------------------------------------------

    def stream_attached(self, run_id: str, member_id: str, incarnation: int) -> None:
        """A stream (Session, Work) now carries this live member's traffic."""
        key = (run_id, member_id, incarnation)
        self._streams[key] += 1
        self._stream_lost.pop(key, None)

    def stream_detached(self, run_id: str, member_id: str, incarnation: int, *, abrupt: bool) -> None:
        """A stream of this member ended. ``abrupt``: it broke (its process died, its connection
        was reset) instead of being closed by the client; if no other stream of the member is open
        and none reopens within ``stream_grace_s``, the member is evicted then, not a lease later."""
        key = (run_id, member_id, incarnation)
        self._streams[key] -= 1
        if self._streams[key] > 0:
            return
        del self._streams[key]
        run = self.runs.get(run_id)
        if abrupt and run is not None and run.is_live(member_id, incarnation):
            self._stream_lost[key] = self.clock()
            log.info("run %s: the stream of member %s broke; evicting it unless it reopens one within %.3fs",
                     run_id, member_id, self.stream_grace_s)

    def _evict_lost_streams(self, now: float) -> None:
        for key, lost_at in list(self._stream_lost.items()):
            if now - lost_at < self.stream_grace_s:
                continue
            del self._stream_lost[key]
            run_id, member_id, incarnation = key
            run = self.runs.get(run_id)
            if run is None or not run.is_live(member_id, incarnation):
                continue
            self._remove(
                run, run.members[member_id], MemberStatus.EVICTED,
                f"its stream broke and did not reopen within {self.stream_grace_s:.3f}s (the process died?)",
            )
            self.metrics.evictions.inc(run=run_id, reason="stream_lost")

    def tick(self, stalled_s: float = 0.0) -> None:
        """Evict expired leases and broken streams, decide whatever passed its deadline. Called
        every tick; ``stalled_s``: seconds the coordinator could not listen (``policy.stall_credit``),
        added to every live lease and open barrier's deadline first."""
        now = self.clock()
        if self._stream_lost:
            self._evict_lost_streams(now)
        for run in list(self.runs.values()):
            if stalled_s:
                policy.extend_leases(run, stalled_s)
                policy.extend_barriers(run, stalled_s)
            if now >= run.lease_floor:  # else no lease can have expired: no O(members) scan this tick
                for m in policy.expired_members(run, now):
                    self._remove(run, m, MemberStatus.EVICTED, f"lease expired ({m.lease_ttl_s:.3f}s without keep-alive)")
                    self.metrics.evictions.inc(run=run.run_id, reason="lease_expired")
                run.lease_floor = policy.lease_floor(run)
            for barrier in list(run.open_barriers.values()):
                if now >= barrier.deadline:
                    self._decide_barrier(run, barrier)
            if run.rendezvous.waiting:
                self._decide_round(run)

    # -- rendezvous rounds -------------------------------------------------------------------

    async def round_join(
        self,
        run_id: str,
        member_id: str,
        incarnation: int,
        config: RoundConfig,
        *,
        after_round: int,
        wait_s: float,
    ) -> RoundResult:
        run = self._run(run_id)
        if run.closed:
            return RoundResult("closed", reason=f"run {run_id!r} is closed: {run.close_reason}")
        self._fence(run, member_id, incarnation)
        rdzv = run.rendezvous
        cfg = rdzv.config
        # A new --nnodes is taken once no live node is in the run's rounds (the last one's
        # participants, or waiting for the next): a job started again with another size (a new
        # Kubernetes Job with another MAX) goes on with the same run. Nodes of the new job that
        # joined but have not asked for a round yet do not count: they pass the new size too.
        resized = cfg is not None and (cfg.min_nodes, cfg.max_nodes) != (config.min_nodes, config.max_nodes)
        if resized and any(
            m != member_id and run.is_live(m, inc) for m, inc in [*rdzv.participants, *rdzv.waiting.items()]
        ):
            raise InvalidRequestError(
                f"config: --nnodes={config.min_nodes}:{config.max_nodes} differs from the run's "
                f"{cfg.min_nodes}:{cfg.max_nodes}; every node must pass the same --nnodes (a new one is "
                "taken only once no node of the run's rounds is live)"
            )
        reason = self._take_timed_out(run, member_id)
        if reason is not None:
            return RoundResult("timed_out", reason=reason)
        done = self._round_result(run, member_id, incarnation, after_round)
        if done is not None:
            return done
        if rdzv.waiting.get(member_id) != incarnation or resized:
            # The first waiter fixes the config; it is persisted with the waiting set.
            pending = copy_rendezvous(rdzv)
            if resized:
                log.warning("run %s: --nnodes=%d:%d (from %s) replaces %d:%d: no node of its rounds was left", run_id,
                            config.min_nodes, config.max_nodes, member_id, cfg.min_nodes, cfg.max_nodes)
            if pending.config is None or resized:
                pending.config = config
            pending.waiting[member_id] = incarnation
            log.info(
                "run %s: %s waits for round %d (%d waiting)", run_id, member_id, pending.round + 1, len(pending.waiting),
            )
            self._decide_round(run, pending)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            rdzv = run.rendezvous  # replaced by every change (see _commit_rendezvous): read it afresh
            if run.closed:
                return RoundResult("closed", reason=f"run {run_id!r} is closed: {run.close_reason}")
            reason = self._take_timed_out(run, member_id)
            if reason is not None:
                return RoundResult("timed_out", reason=reason)
            if not run.is_live(member_id, incarnation):
                self._fence(run, member_id, incarnation)  # raises FencedError with the reason
            done = self._round_result(run, member_id, incarnation, after_round)
            if done is not None:
                return done
            left = deadline - loop.time()
            if left <= 0:
                if policy.standby(rdzv, run):
                    return RoundResult("waiting", rdzv.round, reason=f"standby: round {rdzv.round} is full and running",
                                       standby=True)
                return RoundResult("waiting", rdzv.round, reason=f"{len(rdzv.waiting)} node(s) waiting")
            await self._round_signals.wait(run_id, left)

    @staticmethod
    def _round_result(run: Run, member_id: str, incarnation: int, after_round: int) -> RoundResult | None:
        rdzv = run.rendezvous
        if rdzv.round <= after_round:
            return None
        for rank, (mid, inc) in enumerate(rdzv.participants):
            if mid == member_id and inc == incarnation:
                ids = tuple(m for m, _ in rdzv.participants)
                return RoundResult("complete", rdzv.round, rank, ids, f"round {rdzv.round}")
        return None

    def _take_timed_out(self, run: Run, member_id: str) -> str | None:
        """Consume ``member_id``'s timeout report, if it has one. The report is persisted, so taking
        it is a change too: if that write fails the report stays and the call fails."""
        if member_id not in run.rendezvous.timed_out:
            return None
        pending = copy_rendezvous(run.rendezvous)
        reason = pending.timed_out.pop(member_id)
        self._commit_rendezvous(run, pending)
        return reason

    def _decide_round(self, run: Run, pending: Rendezvous | None = None) -> None:
        """Decide the pending round and make the outcome, with ``pending``'s changes, one change.

        ``pending``: a changed copy of ``run.rendezvous`` (a new waiter, waiters gone), or None to
        decide on the current state. Whatever is decided is applied to a copy, persisted in one
        transaction, and only then swapped in; a failed write leaves ``run.rendezvous`` as it was.
        """
        now = self.clock()
        if pending is not None:
            _track_waiting(pending, now)  # the policy needs min_reached_at of the new waiting set
        decision = policy.decide_round(run.rendezvous if pending is None else pending, run, now)
        if decision.action == "wait":
            if decision.standby:  # (in-memory times: nothing to persist)
                waiting = run.rendezvous if pending is None else pending
                waiting.waiting_since = waiting.min_reached_at = now
            if pending is not None:
                self._commit_rendezvous(run, pending)
            return
        if pending is None:
            pending = copy_rendezvous(run.rendezvous)
        if decision.action == "timeout":
            for mid in pending.waiting:
                pending.timed_out[mid] = decision.reason
            pending.waiting = {}
        else:
            chosen = {m for m, _ in decision.participants}
            pending.round += 1
            pending.participants = list(decision.participants)
            pending.waiting = {m: i for m, i in pending.waiting.items() if m not in chosen}
            # Those left waiting wait for the next round from now: its last call, its hold for
            # this round's participants and its join timeout start over. (Kept, the old times
            # made them a round at once, often in the same tick: the hold was over before this
            # round's participants even had their answer, and those woken in that tick were in
            # neither round.)
            pending.waiting_since = pending.min_reached_at = None
        _track_waiting(pending, now)
        self._commit_rendezvous(run, pending)
        if decision.action == "timeout":
            log.warning("run %s: pending round timed out: %s", run.run_id, decision.reason)
        else:
            log.info(
                "run %s: round %d complete with %d node(s) [%s]: %s",
                run.run_id, pending.round, len(pending.participants),
                ", ".join(m for m, _ in pending.participants), decision.reason,
            )
        self.metrics.rounds.inc(run=run.run_id, outcome=decision.action)
        self._notify_round(run.run_id)

    def _commit_rendezvous(self, run: Run, pending: Rendezvous) -> None:
        """Persist ``pending`` as the run's rendezvous state, then swap it in and tell watchers."""
        with self.db.tx() as db:
            db.put_rendezvous(run.run_id, pending)
        run.rendezvous = pending
        self._emit(run, Event("round", None, run.epoch, f"{len(pending.waiting)} waiting"))

    def _notify_round(self, run_id: str) -> None:
        self._round_signals.fire(run_id)

    def close_run(self, run_id: str, reason: str) -> None:
        run = self._run(run_id)
        if run.closed:
            return
        with self.db.tx() as db:
            db.put_run(run, closed=True, reason=reason or "closed")
        run.closed, run.close_reason = True, reason or "closed"
        log.info("run %s closed: %s", run_id, run.close_reason)
        self._emit(run, Event("closed", None, run.epoch, run.close_reason))
        self._notify_round(run_id)
        for listener in self.run_closed_listeners:
            listener(run_id, run.close_reason)

    # -- watch -------------------------------------------------------------------------------

    def subscribe(self, run_id: str) -> Watcher:
        watcher = Watcher()
        self._watchers.setdefault(run_id, set()).add(watcher)
        return watcher

    def unsubscribe(self, run_id: str, watcher: Watcher) -> None:
        watchers = self._watchers.get(run_id)
        if watchers is not None:
            watchers.discard(watcher)
            if not watchers:
                del self._watchers[run_id]

    def _emit(self, run: Run, event: Event) -> None:
        for watcher in self._watchers.get(run.run_id, ()):
            watcher.push(event)

    def lease_left_s(self, m: Member) -> float:
        return max(0.0, m.lease_deadline - self.clock()) if m.live else 0.0


def _track_waiting(rdzv: Rendezvous, now: float) -> None:
    """Set when the waiting set became non-empty and when it reached min_nodes (in-memory times,
    never persisted) after ``rdzv.waiting`` changed."""
    n = len(rdzv.waiting)
    if n == 0:
        rdzv.waiting_since = rdzv.min_reached_at = None
        return
    if rdzv.waiting_since is None:
        rdzv.waiting_since = now
    if rdzv.config is not None and n >= rdzv.config.min_nodes:
        if rdzv.min_reached_at is None:
            rdzv.min_reached_at = now
    else:
        rdzv.min_reached_at = None
