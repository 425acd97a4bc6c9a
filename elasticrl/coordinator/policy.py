"""Pure decisions of the coordinator: functions of (state, now) that return a decision and a reason.

Nothing here reads a clock, touches a socket or writes to disk, so every timing rule (lease
expiry, barrier release and timeout, rendezvous completion) is tested with an injected ``now``
and no sleeps (``tests/unit/test_policy.py``). ``core`` applies the decisions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from elasticrl.coordinator.state import (
    Barrier,
    BarrierResult,
    Member,
    MemberStatus,
    Outcome,
    Rendezvous,
    Run,
    TimeoutPolicy,
)


def expired_members(run: Run, now: float) -> list[Member]:
    """Live members whose lease deadline has passed, oldest deadline first."""
    gone = [m for m in run.members.values() if m.live and now >= m.lease_deadline]
    return sorted(gone, key=lambda m: m.lease_deadline)


STALL_CREDIT_MIN_S = 0.1
"""A tick this late or later means the coordinator was too busy to read what reached it."""


def stall_credit(late_s: float, *, tick_s: float) -> float:
    """Seconds by which to push back every live lease after a tick that ran ``late_s`` after it
    was due: time the coordinator spent unable to read its sockets (an overloaded event loop, a
    join storm of thousands of members) must not count against leases, whose keep-alives may be
    waiting, unread, in its queues. A dead member is then evicted that much later, never earlier;
    a member whose process died is still evicted at once by its stream breaking."""
    return late_s if late_s >= max(STALL_CREDIT_MIN_S, 2 * tick_s) else 0.0


def extend_leases(run: Run, seconds: float) -> None:
    for m in run.members.values():
        if m.live:
            m.lease_deadline += seconds


def extend_barriers(run: Run, seconds: float) -> None:
    """Push back every open barrier's deadline, as ``extend_leases`` does leases: an arrival sent
    before the deadline may be waiting, unread, in the coordinator's queues after a stall (its
    member would be evicted as missing)."""
    for barrier in run.open_barriers.values():
        barrier.opened_at += seconds  # (its deadline is opened_at + timeout_s)


def lease_floor(run: Run) -> float:
    """The earliest lease deadline of a live member (infinity without one)."""
    return min((m.lease_deadline for m in run.members.values() if m.live), default=math.inf)


def next_deadline(run: Run) -> float | None:
    """The earliest moment at which something in ``run`` may need a decision without a request."""
    times = [m.lease_deadline for m in run.members.values() if m.live]
    times += [b.deadline for b in run.open_barriers.values()]
    rdzv = run.rendezvous
    if rdzv.config is not None and rdzv.waiting:
        if rdzv.min_reached_at is not None:
            times.append(rdzv.min_reached_at + rdzv.config.last_call_s)
            if rdzv.round > 0 and rdzv.config.rejoin_timeout_s > rdzv.config.last_call_s:
                times.append(rdzv.min_reached_at + rdzv.config.rejoin_timeout_s)
        if rdzv.waiting_since is not None:
            times.append(rdzv.waiting_since + rdzv.config.join_timeout_s)
    return min(times) if times else None


@dataclasses.dataclass(frozen=True)
class BarrierDecision:
    """``result`` is None while the barrier must keep waiting; ``evict`` lists members to remove."""

    result: BarrierResult | None
    evict: tuple[str, ...]
    reason: str


def decide_barrier(barrier: Barrier, run: Run, now: float) -> BarrierDecision:
    """Decide whether ``barrier`` can be released.

    A barrier waits for the members that were live when it opened (``expected``). An expected
    member whose incarnation is no longer live never blocks it and is reported as evicted. At the
    deadline the policy either evicts the stragglers and completes (EVICT_MISSING) or reports them
    with outcome TIMED_OUT (REPORT).
    """
    if barrier.result is not None:
        return BarrierDecision(barrier.result, (), "already decided")
    # One pass over the expected members and one over the arrived, liveness inlined (run.is_live):
    # this runs once per barrier over every member.
    members, live_status, got = run.members, MemberStatus.LIVE, barrier.arrived
    gone, waiting_for = [], []
    for m, inc in barrier.expected.items():
        member = members.get(m)
        if member is None or member.status is not live_status or member.incarnation != inc:
            gone.append(m)
        elif got.get(m) != inc:
            waiting_for.append(m)
    gone.sort()
    waiting_for.sort()
    arrived = []
    for m, inc in got.items():
        member = members.get(m)
        if member is not None and member.status is live_status and member.incarnation == inc:
            arrived.append(m)
    arrived.sort()
    if not waiting_for:
        reason = f"all {len(arrived)} live members arrived"
        if gone:
            reason += f"; {len(gone)} expected member(s) gone: {', '.join(gone)}"
        return BarrierDecision(
            BarrierResult(Outcome.COMPLETED, arrived, gone, [], run.epoch, reason), (), reason
        )
    if now < barrier.deadline:
        return BarrierDecision(None, (), f"waiting for {len(waiting_for)} member(s)")
    late = ", ".join(waiting_for)
    if barrier.policy is TimeoutPolicy.REPORT:
        reason = f"timed out after {barrier.timeout_s:.3f}s; missing: {late}"
        result = BarrierResult(Outcome.TIMED_OUT, arrived, gone, waiting_for, run.epoch, reason)
        return BarrierDecision(result, (), reason)
    reason = f"timed out after {barrier.timeout_s:.3f}s; evicted the missing: {late}"
    # The epoch is the one after the evictions; core bumps it once per evicted member.
    result = BarrierResult(
        Outcome.COMPLETED,
        arrived,
        sorted(gone + waiting_for),
        waiting_for,
        run.epoch + len(waiting_for),
        reason,
    )
    return BarrierDecision(result, tuple(waiting_for), reason)


def barrier_blocked(barrier: Barrier, run: Run, now: float, candidates: Iterable[str]) -> bool:
    """True when ``decide_barrier`` would answer "wait": before the deadline, some expected member
    in ``candidates`` is live and has not arrived.

    ``candidates`` must hold every expected member that is live and has not arrived (it may hold
    more). Callers that keep such a set up to date per arrival get an answer in O(1) for the
    common case, where ``decide_barrier`` is O(expected members): deciding on every arrival made
    a barrier of N members cost O(N^2).
    """
    if barrier.result is not None or now >= barrier.deadline:
        return False
    expected, arrived = barrier.expected, barrier.arrived
    return any(run.is_live(m, expected[m]) and arrived.get(m) != expected[m] for m in candidates)


@dataclasses.dataclass(frozen=True)
class RoundDecision:
    """``action`` is "complete", "timeout" or "wait"; ``participants`` is in rank order."""

    action: str
    participants: tuple[tuple[str, int], ...]
    reason: str
    standby: bool = False
    """A wait of standbys (the previous round full and all of it live): their last call and hold
    start when it has room, not while they wait behind it."""


def standby(rdzv: Rendezvous, run: Run, waiting: set[str] | None = None, prev_live: list[str] | None = None) -> bool:
    """Whether the nodes waiting are standbys: the previous round is full (max_nodes) and every
    node of it live (running), and none of it waits again."""
    cfg = rdzv.config
    if cfg is None or rdzv.round == 0 or len(rdzv.participants) < cfg.max_nodes:
        return False
    if prev_live is None:
        prev_live = [m for m, inc in rdzv.participants if run.is_live(m, inc)]
    return len(prev_live) == len(rdzv.participants) and set(rdzv.waiting if waiting is None else waiting).isdisjoint(prev_live)


def decide_round(rdzv: Rendezvous, run: Run, now: float) -> RoundDecision:
    """Decide whether the pending rendezvous round completes now.

    Nodes waiting while the previous round is full and all of it live are standbys: they wait,
    however many and for however long, until a node of that round is lost or waits again (torch's
    c10d keeps such nodes idle too). Otherwise: complete when max_nodes are waiting; or when
    min_nodes are waiting and every live participant of the previous round is among them (a
    re-form after a failure needs no last-call wait); or when min_nodes have been waiting for the
    last-call window, held (a re-form only) up to the rejoin timeout while a live participant of
    the previous round has not rejoined: an agent slow to stop its workers would otherwise be left
    out, and come back as one more re-form. Time out when min_nodes were not reached within the
    join timeout of the first waiter. (The times count from when the waiters stopped being
    standbys, or from the last round's completion for those it left waiting: the core resets them.)
    """
    cfg = rdzv.config
    waiting = [(m, inc) for m, inc in rdzv.waiting.items() if run.is_live(m, inc)]
    if cfg is None or not waiting:
        return RoundDecision("wait", (), "nobody is waiting")
    n = len(waiting)
    ids = {m for m, _ in waiting}
    prev_live = [m for m, inc in rdzv.participants if run.is_live(m, inc)]
    if standby(rdzv, run, ids, prev_live):
        # Its agents re-form only when a node of it is lost or fails, and the standbys join that
        # round; a round of standbys alone would take the job from the nodes running it.
        return RoundDecision("wait", (), f"{n} standby node(s): round {rdzv.round} is full and running", standby=True)
    if n >= cfg.min_nodes:
        started = rdzv.min_reached_at if rdzv.min_reached_at is not None else now
        last_call_over = now >= started + cfg.last_call_s
        held = [m for m in prev_live if m not in ids]
        hold_over = now >= started + max(cfg.last_call_s, cfg.rejoin_timeout_s)  # held is empty in round 0
        if n >= cfg.max_nodes:
            # A standby newcomer must not take the slot of a live participant of the previous
            # round that is still restarting: hold the slots until it rejoins or the hold ends.
            if held and not hold_over:
                return RoundDecision("wait", (), f"holding slots for {', '.join(held)} of round {rdzv.round}")
            chosen = _prefer_previous(rdzv.participants, waiting)[: cfg.max_nodes]
            return RoundDecision(
                "complete", assign_ranks(rdzv.participants, chosen), f"max_nodes={cfg.max_nodes} joined"
            )
        if rdzv.round > 0 and prev_live and all(m in ids for m in prev_live):
            return RoundDecision(
                "complete",
                assign_ranks(rdzv.participants, waiting),
                f"all {len(prev_live)} live participant(s) of round {rdzv.round} rejoined, {n} node(s) in all",
            )
        if held and last_call_over and not hold_over:
            return RoundDecision("wait", (), f"holding for {', '.join(held)} of round {rdzv.round} (rejoin timeout)")
        if last_call_over:
            return RoundDecision(
                "complete",
                assign_ranks(rdzv.participants, waiting),
                f"last call ({cfg.last_call_s:.3f}s) closed with {n} node(s)",
            )
        return RoundDecision("wait", (), f"{n} node(s) waiting, last call open")
    since = rdzv.waiting_since if rdzv.waiting_since is not None else now
    if now >= since + cfg.join_timeout_s:
        return RoundDecision(
            "timeout",
            (),
            f"only {n} of min_nodes={cfg.min_nodes} joined within the join timeout of {cfg.join_timeout_s:.1f}s",
        )
    return RoundDecision("wait", (), f"{n} of min_nodes={cfg.min_nodes} waiting")


def _prefer_previous(
    previous: list[tuple[str, int]], waiting: list[tuple[str, int]]
) -> list[tuple[str, int]]:
    prev_ids = {m for m, _ in previous}
    return [w for w in waiting if w[0] in prev_ids] + [w for w in waiting if w[0] not in prev_ids]


def assign_ranks(
    previous: list[tuple[str, int]], joined: list[tuple[str, int]]
) -> tuple[tuple[str, int], ...]:
    """Order ``joined`` by rank, keeping each node's previous rank where it still fits.

    Nodes whose previous rank is below the new world size keep it; the remaining slots are filled
    first by the other previous participants (in their old rank order), then by newcomers in the
    order they joined.
    """
    n = len(joined)
    prev_rank = {m: r for r, (m, _) in enumerate(previous)}
    slots: list[tuple[str, int] | None] = [None] * n
    rest = []
    for node in joined:
        r = prev_rank.get(node[0])
        if r is not None and r < n and slots[r] is None:
            slots[r] = node
        else:
            rest.append(node)
    rest.sort(key=lambda node: (0, prev_rank[node[0]]) if node[0] in prev_rank else (1, 0))
    free = iter(i for i, s in enumerate(slots) if s is None)
    for node in rest:
        slots[next(free)] = node
    return tuple(s for s in slots if s is not None)


def nodes_waiting(
    my_round: int,
    round_no: int,
    participants: list[str],
    waiting: list[str],
    lost: list[str],
    max_nodes: int,
    *,
    count_lost: bool = True,
) -> int:
    """How many nodes want the current round re-formed, as torchrun's ``num_nodes_waiting`` means it.

    Counts participants of the current round that are gone (so survivors restart at once instead
    of hanging in a collective; not with ``count_lost=False``, where the survivors' workers re-form
    in place), participants that wait again (their workers failed, so the round is broken even
    when it is full), other waiting nodes while the round has room for them (a lost node's place
    is room), and one more when a newer round than ``my_round`` has already completed without this node.
    """
    current = set(participants)
    rejoining = [m for m in waiting if m in current]
    newcomers = [m for m in waiting if m not in current]
    count = (len(lost) if count_lost else 0) + len(rejoining)
    if newcomers and (len(participants) - len(lost)) < max_nodes:
        count += len(newcomers)
    if round_no > my_round:
        count += 1
    return count
