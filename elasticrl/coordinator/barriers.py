"""Leased barriers, a part of ``CoordinatorCore`` kept in its own module.

It follows the core's rule (decide, write to SQLite in one transaction, then change memory, then
wake waiters) and uses the core's state: ``runs``, ``db``, ``limits``, ``metrics``, ``clock`` and
its run lookups, fencing and membership paths (``_run``, ``_fence``, ``_mark_gone``,
``_after_membership_change``).

Arrivals come in groups: a batched Session message carries the arrivals of every member a process
hosts, and ``arrive_many`` records them all in one transaction (one SQLite commit per message
instead of one per member) before memory changes, then decides each touched barrier once. The
servicers call ``arrive_together``: a durable coordinator records every call made in one turn of
the event loop in one transaction (group commit), so the messages of many streams read in that
turn, one member's each on the stream-per-member transport, cost one commit, not one each. A
decided barrier wakes its waiters through ``signals``: futures for the unary ``Arrive`` and one
callback per waiting Session stream (``listen``), so a release costs O(streams), not a task per
member.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable, Hashable

from elasticrl.coordinator import policy
from elasticrl.coordinator.metrics import Metrics
from elasticrl.coordinator.persist import StateDB
from elasticrl.coordinator.signals import Signals
from elasticrl.coordinator.state import Barrier, BarrierResult, MemberStatus, Outcome, Run, TimeoutPolicy
from elasticrl.errors import ResourceLimitError

log = logging.getLogger(__name__)


DEFAULT_BARRIER_TIMEOUT_S = 600.0
"""A barrier's timeout when an arrival names none (``timeout_ms`` 0)."""


@dataclasses.dataclass(slots=True)
class Arrival:
    """One member's arrival at barrier ``name`` (validated by the servicer). Not frozen, though
    nothing changes one: a frozen dataclass's ``__init__`` costs ~0.6 us, six times a plain one,
    once per member per barrier."""

    run_id: str
    member_id: str
    incarnation: int
    name: str
    epoch: int = 0
    timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S
    policy: TimeoutPolicy = TimeoutPolicy.EVICT_MISSING


def _key(a: Arrival) -> tuple[str, str, str, int]:
    return (a.run_id, a.name, a.member_id, a.incarnation)


class BarrierOps:
    """Mixed into ``CoordinatorCore``, which provides these (and ``limits``, ``_run``, ``_fence``,
    ``_mark_gone``, ``_after_membership_change``)."""

    runs: dict[str, Run]
    db: StateDB
    metrics: Metrics
    clock: Callable[[], float]
    _barrier_signals: Signals
    # Per open barrier, a superset of the expected members that are live and have not arrived
    # (built on first use, shrunk per arrival): lets an arrival skip the O(N) decision.
    _not_arrived: dict[tuple[str, str], set[str]]
    # Calls of arrive_together waiting for this turn of the event loop to end: (arrivals, future).
    _together: list[tuple[list[Arrival], asyncio.Future]]

    async def arrive(
        self,
        run_id: str,
        member_id: str,
        incarnation: int,
        name: str,
        *,
        epoch: int = 0,
        timeout_s: float,
        policy_: TimeoutPolicy = TimeoutPolicy.EVICT_MISSING,
        wait_s: float = 0.0,
    ) -> BarrierResult | None:
        """Record an arrival and wait up to ``wait_s`` (0: until decided) for the barrier's result.

        Returns None when the wait ran out first; arriving again keeps the same place.
        """
        arrival = Arrival(run_id, member_id, incarnation, name, epoch, timeout_s, policy_)
        (result,) = await self.arrive_together([arrival])
        if isinstance(result, Exception):
            raise result
        # (a durable core answers at the end of the turn and this resumes at the next: what ran
        # in between, a tick or another call, may have decided the barrier and fired already)
        if result is None:
            result = self.arrival_result(arrival)
        if result is not None:
            return result
        await self._barrier_signals.wait((run_id, name), wait_s if wait_s > 0 else None)
        return self.arrival_result(arrival)

    async def arrive_together(self, arrivals: list[Arrival]) -> list[BarrierResult | None | Exception]:
        """``arrive_many(arrivals)``, in one transaction with every other call made in this turn of
        the event loop (group commit). The commit, and so every answer, comes at the end of the
        turn: a durable coordinator pays one commit for all the streams it read in it. A memory-only
        one writes no arrival rows, so it records them at once."""
        if not self.db.durable:
            return self.arrive_many(arrivals)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._together:
            loop.call_soon(self._arrive_queued)
        self._together.append((arrivals, future))
        return await future

    def _arrive_queued(self) -> None:
        calls, self._together = self._together, []
        try:
            results = self.arrive_many([a for arrivals, _ in calls for a in arrivals])
        except Exception as exc:  # noqa: BLE001 - a bug, not one arrival's refusal: every call gets it
            for _, future in calls:
                if not future.done():
                    future.set_exception(exc)
            return
        at = 0
        for arrivals, future in calls:  # a cancelled caller's arrivals stay recorded, as a lost answer's would
            if not future.done():
                future.set_result(results[at:at + len(arrivals)])
            at += len(arrivals)

    def arrival_result(self, arrival: Arrival) -> BarrierResult | None:
        """The decided result for a waiting ``arrival`` (None: not yet). Raises ``FencedError``
        when its member was evicted while it waited."""
        run = self._run(arrival.run_id)
        if not run.is_live(arrival.member_id, arrival.incarnation):
            self._fence(run, arrival.member_id, arrival.incarnation)  # raises FencedError
        barrier = run.barriers.get(arrival.name)
        return None if barrier is None else barrier.result

    def listen(self, run_id: str, name: str, callback: Callable[[], None]) -> Hashable:
        """Call ``callback()`` once when barrier ``name`` is decided (from inside the decision, so
        it must not block or raise); returns a handle for ``unlisten``."""
        return self._barrier_signals.listen((run_id, name), callback)

    def unlisten(self, run_id: str, name: str, handle: Hashable) -> None:
        self._barrier_signals.unlisten((run_id, name), handle)

    def arrive_many(self, arrivals: list[Arrival]) -> list[BarrierResult | None | Exception]:
        """Record ``arrivals`` in one transaction, then decide every barrier they touched.

        Returns, per arrival in order, the barrier's result if it is decided, None if it still
        waits, or the exception that refused this arrival (unknown run, fenced member, too many
        open barriers); one refused arrival does not refuse the others. If the commit fails,
        memory is unchanged and every arrival that was to be written gets that error.
        """
        results: list[BarrierResult | None | Exception] = [None] * len(arrivals)
        # The barrier each arrival found or opened: answered from it, even if a later decision of
        # this call drops it from the run (keep_decided_barriers).
        found: list[Barrier | None] = [None] * len(arrivals)
        created: dict[tuple[str, str], Barrier] = {}  # barriers this call opens, by (run, name)
        writes: list[tuple[int, Run, Barrier]] = []  # arrivals to record, by index
        seen: set[tuple[str, str, str, int]] = set()
        now = self.clock()
        for i, a in enumerate(arrivals):
            try:
                run = self._run(a.run_id)
                self._fence(run, a.member_id, a.incarnation, a.epoch)
                key = (a.run_id, a.name)
                barrier = run.barriers.get(a.name) or created.get(key)
                if barrier is None:
                    if len(run.open_barriers) + sum(k[0] == a.run_id for k in created) >= self.limits.max_barriers_per_run:
                        raise ResourceLimitError(f"run {a.run_id!r} holds {len(run.open_barriers)} open barriers (limit reached)")
                    expected = {mid: m.incarnation for mid, m in run.live_members().items()}
                    barrier = created[key] = Barrier(a.name, a.timeout_s, a.policy, expected, {}, now)
            except Exception as exc:  # noqa: BLE001 - this arrival's error, not the others'
                results[i] = exc
                continue
            found[i] = barrier
            if barrier.result is not None:  # a replay
                continue
            once = _key(a)
            if barrier.arrived.get(a.member_id) != a.incarnation and once not in seen:
                seen.add(once)
                writes.append((i, run, barrier))
        # Barrier and arrival rows are read only when a restarted coordinator loads its state: a
        # memory-only one skips them (at 64 members, 0.2 ms of the 0.4 ms per round of arrive_many).
        if writes and self.db.durable:
            try:
                with self.db.tx() as db:
                    for key, barrier in created.items():
                        db.put_barrier(key[0], barrier)
                    db.put_arrivals([(run.run_id, barrier.name, arrivals[i].member_id, arrivals[i].incarnation)
                                     for i, run, barrier in writes])
            except Exception as exc:  # noqa: BLE001 - nothing was recorded: each arrival to write fails alike
                failed = {_key(arrivals[i]) for i, _, _ in writes}
                for i, a in enumerate(arrivals):  # their repeats, and arrivals at a barrier it was to open, too
                    if results[i] is None and (_key(a) in failed or (a.run_id, a.name) in created):
                        results[i] = exc
                created, writes = {}, []  # memory stays as it was; the rest are answered below
        for (run_id, name), barrier in created.items():  # committed: memory follows
            run = self.runs[run_id]
            run.barriers[name] = run.open_barriers[name] = barrier
        touched: dict[tuple[str, str], tuple[Run, Barrier]] = {}
        for i, run, barrier in writes:
            a = arrivals[i]
            barrier.arrived[a.member_id] = a.incarnation
            pending = self._not_arrived.get((run.run_id, barrier.name))
            if pending is not None:
                pending.discard(a.member_id)  # the arrival passed the fence: expected, or that one is not live
            touched[(run.run_id, barrier.name)] = (run, barrier)
        for key, (run, barrier) in touched.items():
            if barrier.result is None:  # an eviction decided by an earlier barrier re-decides the rest
                self._decide_if_unblocked(run, barrier, fresh=key in created)
        for i, barrier in enumerate(found):
            if results[i] is None and barrier is not None:
                results[i] = barrier.result
        return results

    def _decide_if_unblocked(self, run: Run, barrier: Barrier, *, fresh: bool) -> None:
        """Decide ``barrier`` unless it is plainly still blocked, in O(1) per arrival: the
        not-arrived set is built once per barrier (a fresh one's now: a set left by an earlier
        barrier of that name is not its) and shrunk by every arrival."""
        key = (run.run_id, barrier.name)
        pending = None if fresh else self._not_arrived.get(key)
        if pending is None:
            pending = self._not_arrived[key] = {m for m, inc in barrier.expected.items() if barrier.arrived.get(m) != inc}
        if not policy.barrier_blocked(barrier, run, self.clock(), pending):
            self._decide_barrier(run, barrier)

    def _decide_barrier(self, run: Run, barrier: Barrier) -> None:
        if barrier.result is not None:  # decided meanwhile: an eviction re-decides every open barrier
            return
        decision = policy.decide_barrier(barrier, run, self.clock())
        if decision.result is None:
            return
        late = [run.members[mid] for mid in decision.evict]
        late_reason = f"missed barrier {barrier.name!r} (timeout {barrier.timeout_s:.3f}s)"
        dropped = list(itertools.islice(run.decided, max(0, len(run.decided) + 1 - self.limits.keep_decided_barriers)))
        if late or self.db.durable:
            with self.db.tx() as db:  # the evictions and the result commit together, or neither does
                for m in late:
                    db.put_member(run.run_id, m, status=MemberStatus.EVICTED, reason=late_reason)
                if late:
                    db.put_run(run, epoch=run.epoch + len(late))
                if db.durable:  # (see arrive_many)
                    db.put_barrier(run.run_id, barrier, decision.result)
                    db.delete_arrivals(run.run_id, barrier.name)
                    for name in dropped:
                        db.delete_barrier(run.run_id, name)
        for name in dropped:  # committed: memory follows
            run.decided.popleft()
            del run.barriers[name]
        run.decided.append(barrier.name)
        for m in late:
            run.epoch += 1
            self._mark_gone(run, m, MemberStatus.EVICTED, late_reason)
            self.metrics.evictions.inc(run=run.run_id, reason="missed_barrier")
        barrier.result = decision.result
        run.open_barriers.pop(barrier.name, None)
        self.metrics.barriers_decided.inc(run=run.run_id, outcome=decision.result.outcome.value)
        self.metrics.barrier_wait.observe(self.clock() - barrier.opened_at, run=run.run_id)
        self._not_arrived.pop((run.run_id, barrier.name), None)
        if decision.result.outcome is Outcome.TIMED_OUT or decision.result.evicted:
            log.warning("run %s: barrier %s: %s", run.run_id, barrier.name, decision.reason)
        else:
            log.debug("run %s: barrier %s: %s", run.run_id, barrier.name, decision.reason)
        self._barrier_signals.fire((run.run_id, barrier.name))
        if late:  # an eviction, whatever its cause, re-decides every other open barrier at once
            self._after_membership_change(run)
