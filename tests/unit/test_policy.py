"""Pure policy: leases, barriers and rendezvous rounds decided from (state, now). No sleeps."""

from __future__ import annotations

from elasticrl.coordinator import policy
from elasticrl.coordinator.state import (
    Barrier,
    Member,
    MemberStatus,
    Outcome,
    Rendezvous,
    RoundConfig,
    Run,
    TimeoutPolicy,
)


def make_run(*ids: str, now: float = 0.0, ttl: float = 1.0) -> Run:
    run = Run(run_id="r")
    for i, mid in enumerate(ids, start=1):
        run.members[mid] = Member(mid, i, "h", 1.0, {}, i, ttl, now + ttl)
    run.epoch = len(ids)
    return run


def barrier(run: Run, *, timeout_s: float = 10.0, policy_=TimeoutPolicy.EVICT_MISSING, opened_at: float = 0.0) -> Barrier:
    expected = {m.member_id: m.incarnation for m in run.members.values() if m.live}
    return Barrier("b", timeout_s, policy_, expected, {}, opened_at)


def arrive(b: Barrier, run: Run, *ids: str) -> None:
    for mid in ids:
        b.arrived[mid] = run.members[mid].incarnation


# -- leases -------------------------------------------------------------------------------------


def test_lease_expires_exactly_at_ttl():
    run = make_run("a", "b", ttl=2.0)
    run.members["b"].lease_deadline = 5.0
    assert policy.expired_members(run, 1.999) == []
    assert [m.member_id for m in policy.expired_members(run, 2.0)] == ["a"]
    assert [m.member_id for m in policy.expired_members(run, 5.0)] == ["a", "b"]


def test_departed_members_never_expire_again():
    run = make_run("a")
    run.members["a"].status = MemberStatus.EVICTED
    assert policy.expired_members(run, 100.0) == []


def test_next_deadline_is_earliest_of_leases_and_barriers():
    run = make_run("a", ttl=3.0)
    b = barrier(run, timeout_s=1.5, opened_at=0.5)
    run.barriers["b"] = run.open_barriers["b"] = b
    assert policy.next_deadline(run) == 2.0
    del run.open_barriers["b"]  # decided barriers no longer count
    assert policy.next_deadline(run) == 3.0


# -- barriers -----------------------------------------------------------------------------------


def test_barrier_waits_until_every_live_member_arrives():
    run = make_run("a", "b", "c")
    b = barrier(run)
    arrive(b, run, "a", "b")
    d = policy.decide_barrier(b, run, now=1.0)
    assert d.result is None and "1 member" in d.reason
    arrive(b, run, "c")
    d = policy.decide_barrier(b, run, now=1.0)
    assert d.result.outcome is Outcome.COMPLETED
    assert d.result.arrived == ["a", "b", "c"] and d.result.evicted == [] and d.evict == ()


def test_evicted_member_never_blocks_and_is_named():
    run = make_run("a", "b", "c")
    b = barrier(run)
    arrive(b, run, "a", "b")
    run.members["c"].status = MemberStatus.EVICTED
    d = policy.decide_barrier(b, run, now=1.0)
    assert d.result.outcome is Outcome.COMPLETED
    assert d.result.evicted == ["c"] and d.result.arrived == ["a", "b"]
    assert "gone: c" in d.result.reason


def test_replaced_incarnation_counts_as_gone_and_late_joiners_are_not_waited_for():
    run = make_run("a", "b")
    b = barrier(run)
    arrive(b, run, "a")
    # b restarts: a new incarnation replaces the expected one; d joins after the barrier opened.
    run.members["b"] = Member("b", 9, "h", 1.0, {}, 3, 1.0, 10.0)
    run.members["d"] = Member("d", 10, "h", 1.0, {}, 4, 1.0, 10.0)
    d = policy.decide_barrier(b, run, now=0.5)
    assert d.result.outcome is Outcome.COMPLETED and d.result.evicted == ["b"]


def test_timeout_report_policy_lists_missing_and_evicts_nobody():
    run = make_run("a", "b", "c")
    b = barrier(run, timeout_s=5.0, policy_=TimeoutPolicy.REPORT)
    arrive(b, run, "a")
    assert policy.decide_barrier(b, run, now=4.999).result is None
    d = policy.decide_barrier(b, run, now=5.0)
    assert d.result.outcome is Outcome.TIMED_OUT
    assert d.result.missing == ["b", "c"] and d.evict == ()


def test_timeout_evict_policy_completes_with_survivors():
    run = make_run("a", "b", "c")
    b = barrier(run, timeout_s=5.0)
    arrive(b, run, "a", "b")
    d = policy.decide_barrier(b, run, now=5.0)
    assert d.result.outcome is Outcome.COMPLETED
    assert d.evict == ("c",) and d.result.missing == ["c"] and d.result.evicted == ["c"]
    assert d.result.epoch == run.epoch + 1


def test_decided_barrier_stays_decided():
    run = make_run("a")
    b = barrier(run)
    arrive(b, run, "a")
    first = policy.decide_barrier(b, run, now=0.0).result
    b.result = first
    assert policy.decide_barrier(b, run, now=99.0).result is first


# -- rendezvous rounds --------------------------------------------------------------------------


def rdzv(min_nodes=2, max_nodes=4, last_call=1.0, join_timeout=10.0, rejoin=5.0) -> Rendezvous:
    return Rendezvous(config=RoundConfig(min_nodes, max_nodes, last_call, join_timeout, rejoin))


def wait(r: Rendezvous, run: Run, *ids: str, since: float = 0.0) -> None:
    for mid in ids:
        r.waiting[mid] = run.members[mid].incarnation
    r.waiting_since = since
    if len(r.waiting) >= r.config.min_nodes:
        r.min_reached_at = since


def test_first_round_waits_for_last_call_then_completes():
    run = make_run("a", "b", "c")
    r = rdzv()
    wait(r, run, "a", "b")
    assert policy.decide_round(r, run, now=0.5).action == "wait"
    d = policy.decide_round(r, run, now=1.0)
    assert d.action == "complete" and [m for m, _ in d.participants] == ["a", "b"]
    assert "last call" in d.reason


def test_round_completes_at_once_with_max_nodes():
    run = make_run("a", "b", "c")
    r = rdzv(max_nodes=3)
    wait(r, run, "c", "a", "b")
    d = policy.decide_round(r, run, now=0.0)
    assert d.action == "complete" and len(d.participants) == 3


def test_reform_skips_last_call_when_survivors_rejoined():
    run = make_run("a", "b", "c")
    r = rdzv()
    r.round, r.participants = 1, [("a", 1), ("b", 2), ("c", 3)]
    run.members["a"].status = MemberStatus.EVICTED
    wait(r, run, "c", "b", since=5.0)
    d = policy.decide_round(r, run, now=5.0)
    assert d.action == "complete" and "rejoined" in d.reason
    # b and c keep their old ranks where they fit: c had rank 2 which no longer exists.
    assert [m for m, _ in d.participants] == ["c", "b"]


def test_full_round_holds_slots_for_restarting_participants():
    run = make_run("a", "b", "standby")
    r = rdzv(max_nodes=2, last_call=1.0)
    r.round, r.participants = 1, [("a", 1), ("b", 2)]
    # a's workers failed and it rejoined; the standby node is waiting; b is still restarting
    wait(r, run, "standby", "a", since=3.0)
    assert policy.decide_round(r, run, now=3.5).action == "wait"
    r.waiting["b"] = 2
    d = policy.decide_round(r, run, now=3.5)
    assert d.action == "complete" and [m for m, _ in d.participants] == ["a", "b"]
    # if b never comes back, the standby node gets the slot when the rejoin hold ends
    del r.waiting["b"]
    assert policy.decide_round(r, run, now=7.9).action == "wait"
    d = policy.decide_round(r, run, now=8.0)
    assert d.action == "complete" and {m for m, _ in d.participants} == {"a", "standby"}


def test_reform_holds_past_last_call_for_a_live_participant_still_stopping_its_workers():
    """c died; b's agent is alive but its worker takes seconds to stop. Closing at last call would
    form a world of one and re-form again when b comes: hold for b, up to the rejoin timeout."""
    run = make_run("a", "b", "c")
    run.members["c"].status = MemberStatus.EVICTED
    r = rdzv(min_nodes=1, max_nodes=3, last_call=1.0, rejoin=5.0)
    r.round, r.participants = 1, [("a", 1), ("b", 2), ("c", 3)]
    wait(r, run, "a", since=10.0)
    d = policy.decide_round(r, run, now=12.0)  # past last call
    assert d.action == "wait" and "holding for b" in d.reason
    r.waiting["b"] = 2
    d = policy.decide_round(r, run, now=12.0)
    assert d.action == "complete" and [m for m, _ in d.participants] == ["a", "b"]
    # b's agent never rejoins (wedged): the hold ends and a goes on alone
    del r.waiting["b"]
    d = policy.decide_round(r, run, now=15.0)
    assert d.action == "complete" and [m for m, _ in d.participants] == ["a"]
    # rejoin_timeout 0: no hold, the last call decides as before
    r.config.rejoin_timeout_s = 0.0
    assert policy.decide_round(r, run, now=11.0).action == "complete"
    # a first round has no previous participants to hold for
    first = rdzv(min_nodes=1, max_nodes=3)
    wait(first, run, "a", since=0.0)
    assert policy.decide_round(first, run, now=1.0).action == "complete"


def test_round_times_out_below_min_nodes():
    run = make_run("a", "b")
    r = rdzv(min_nodes=3, max_nodes=3, join_timeout=10.0)
    wait(r, run, "a", "b", since=2.0)
    assert policy.decide_round(r, run, now=11.9).action == "wait"
    d = policy.decide_round(r, run, now=12.0)
    assert d.action == "timeout" and "min_nodes=3" in d.reason


def test_dead_waiters_do_not_count():
    run = make_run("a", "b")
    r = rdzv()
    wait(r, run, "a", "b")
    run.members["b"].status = MemberStatus.EVICTED
    assert policy.decide_round(r, run, now=5.0).action == "wait"


def test_assign_ranks_keeps_previous_ranks_and_appends_newcomers():
    prev = [("a", 1), ("b", 2), ("c", 3)]
    assert policy.assign_ranks(prev, [("d", 4), ("c", 3), ("a", 1), ("b", 2)]) == (("a", 1), ("b", 2), ("c", 3), ("d", 4))
    # rank 0 died: b keeps rank 1, c (rank 2) moves down into the free slot 0.
    assert policy.assign_ranks(prev, [("b", 2), ("c", 3)]) == (("c", 3), ("b", 2))
    assert policy.assign_ranks([], [("x", 1), ("y", 2)]) == (("x", 1), ("y", 2))


def test_nodes_waiting_counts_lost_waiting_and_newer_rounds():
    assert policy.nodes_waiting(1, 1, ["a", "b"], [], [], 4) == 0
    assert policy.nodes_waiting(1, 1, ["a", "b"], [], ["b"], 4) == 1
    assert policy.nodes_waiting(1, 1, ["a", "b"], ["c"], [], 4) == 1
    # a full round does not restart for standby nodes
    assert policy.nodes_waiting(1, 1, ["a", "b"], ["c"], [], 2) == 0
    assert policy.nodes_waiting(1, 2, ["b", "c"], [], [], 4) == 1


def test_nodes_waiting_in_place_leaves_lost_nodes_to_the_workers():
    """in_place: a lost participant restarts nobody (its survivors' workers re-form by themselves),
    but its place is room for a node that joins, which still restarts everyone into the larger world."""
    assert policy.nodes_waiting(1, 1, ["a", "b", "c"], [], ["c"], 3, count_lost=False) == 0
    assert policy.nodes_waiting(1, 1, ["a", "b", "c"], ["d"], ["c"], 3, count_lost=False) == 1
    assert policy.nodes_waiting(1, 1, ["a", "b", "c"], ["d"], [], 3, count_lost=False) == 0  # full: d stands by
    assert policy.nodes_waiting(1, 1, ["a", "b", "c"], ["a"], ["c"], 3, count_lost=False) == 1  # a's workers failed


def test_barrier_blocked_agrees_with_decide_barrier_on_random_states():
    """The O(1) per-arrival check must never say "blocked" when the full decision would release."""
    import random

    rng = random.Random(7)
    for _ in range(2000):
        ids = [f"m{i}" for i in range(rng.randint(1, 8))]
        run = make_run(*ids)
        b = barrier(run, timeout_s=10.0, policy_=rng.choice(list(TimeoutPolicy)))
        for mid in ids:
            roll = rng.random()
            if roll < 0.5:
                arrive(b, run, mid)
            if rng.random() < 0.2:
                run.members[mid].status = MemberStatus.EVICTED
            elif rng.random() < 0.1:  # replaced by a new incarnation after the barrier opened
                run.members[mid] = Member(mid, 100 + len(ids), "h", 1.0, {}, 9, 1.0, 10.0)
        now = rng.choice([0.0, 5.0, 10.0, 11.0])
        # any superset of the not-arrived expected members is a valid candidate set
        not_arrived = {m for m, inc in b.expected.items() if b.arrived.get(m) != inc}
        candidates = not_arrived | set(rng.sample(ids, rng.randint(0, len(ids))))
        blocked = policy.barrier_blocked(b, run, now, candidates)
        assert blocked == (policy.decide_barrier(b, run, now).result is None)
