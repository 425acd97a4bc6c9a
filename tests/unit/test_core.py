"""CoordinatorCore with an injected clock: fencing, epochs, ticks, KV, persistence and reload."""

from __future__ import annotations

import asyncio

import pytest

from elasticrl.coordinator.core import CoordinatorCore, Limits
from elasticrl.coordinator.persist import StateDB
from elasticrl.coordinator.state import MemberStatus, Outcome, RoundConfig, TimeoutPolicy
from elasticrl.errors import (
    FencedError,
    InvalidRequestError,
    NotFoundError,
    ResourceLimitError,
    RunClosedError,
    StaleEpochError,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def core(clock) -> CoordinatorCore:
    return CoordinatorCore(StateDB(None), lease_ttl_s=1.0, clock=clock)


def advance(core, clock, seconds, *alive):
    """Move the clock in 0.25 s steps, renewing the leases of ``alive`` members and ticking."""
    steps = round(seconds / 0.25)
    for _ in range(steps):
        clock.now += 0.25
        for m in alive:
            core.keep_alive("r", m.member_id, m.incarnation)
        core.tick()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 5))


def test_join_bumps_epoch_and_rejoin_fences_old_incarnation(core):
    a, e1 = core.join("r", "a")
    b, e2 = core.join("r", "b")
    assert (e1, e2) == (1, 2) and b.incarnation > a.incarnation
    a2, e3 = core.join("r", "a")  # a restarted: the old process is fenced
    assert e3 == 4 and a2.incarnation > b.incarnation
    with pytest.raises(FencedError, match="replaced"):
        core.keep_alive("r", "a", a.incarnation)
    core.keep_alive("r", "a", a2.incarnation)


def test_unknown_member_and_run_are_not_found(core):
    with pytest.raises(NotFoundError, match="run_id"):
        core.keep_alive("nope", "a", 1)
    core.join("r", "a")
    with pytest.raises(NotFoundError, match="never joined"):
        core.keep_alive("r", "ghost", 1)


def test_tick_evicts_after_ttl_and_keepalive_extends(core, clock):
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    clock.now += 0.9
    core.keep_alive("r", "a", a.incarnation)
    clock.now += 0.1
    core.tick()
    assert core.runs["r"].members["b"].status is MemberStatus.EVICTED
    assert core.runs["r"].members["a"].live and core.runs["r"].epoch == 3
    with pytest.raises(FencedError, match="lease expired"):
        core.keep_alive("r", "b", b.incarnation)


def test_stale_epoch_is_refused(core):
    core.join("r", "b")
    a, epoch = core.join("r", "a")
    with pytest.raises(StaleEpochError):
        run(core.arrive("r", "a", a.incarnation, "x", epoch=epoch - 1, timeout_s=5))
    with pytest.raises(InvalidRequestError, match="future"):
        run(core.arrive("r", "a", a.incarnation, "x", epoch=99, timeout_s=5))


def test_barrier_releases_survivors_when_member_expires(core, clock):
    a, _ = core.join("r", "a")
    core.join("r", "b")

    async def scenario():
        waiter = asyncio.create_task(core.arrive("r", "a", a.incarnation, "it-1", timeout_s=60))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        clock.now += 0.5
        core.keep_alive("r", "a", a.incarnation)
        clock.now += 0.5  # b's lease lapses, a's does not
        core.tick()
        return await waiter

    result = run(scenario())
    assert result.outcome is Outcome.COMPLETED and result.evicted == ["b"] and result.arrived == ["a"]


def test_waiter_evicted_while_waiting_is_fenced(core, clock):
    a, _ = core.join("r", "a")
    core.join("r", "b")

    async def scenario():
        waiter = asyncio.create_task(core.arrive("r", "a", a.incarnation, "it-1", timeout_s=60))
        await asyncio.sleep(0.01)
        clock.now += 1.0  # everyone's lease lapses, the waiter's too
        core.tick()
        return await waiter

    with pytest.raises(FencedError, match="lease expired"):
        run(scenario())


def test_arrival_is_idempotent_and_result_is_replayed(core):
    a, _ = core.join("r", "a")
    first = run(core.arrive("r", "a", a.incarnation, "x", timeout_s=5))
    again = run(core.arrive("r", "a", a.incarnation, "x", timeout_s=5))
    assert first is again and first.arrived == ["a"]


def test_barrier_names_are_scoped_by_run(core):
    a1, _ = core.join("run-1", "a")
    core.join("run-1", "b")
    a2, _ = core.join("run-2", "a")
    assert run(core.arrive("run-1", "a", a1.incarnation, "iter-0", timeout_s=5, wait_s=0.01)) is None
    # a restarted run (new id) sees a fresh barrier of the same name, not run-1's arrivals
    result = run(core.arrive("run-2", "a", a2.incarnation, "iter-0", timeout_s=5))
    assert result.arrived == ["a"] and core.runs["run-1"].barriers["iter-0"].result is None


def test_barrier_timeout_report_and_pending_wait(core, clock):
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    assert run(core.arrive("r", "a", a.incarnation, "x", timeout_s=2, policy_=TimeoutPolicy.REPORT, wait_s=0.01)) is None
    advance(core, clock, 2.0, a, b)
    result = run(core.arrive("r", "a", a.incarnation, "x", timeout_s=2))
    assert result.outcome is Outcome.TIMED_OUT and result.missing == ["b"]
    assert core.runs["r"].members["b"].live  # REPORT evicts nobody


def test_barrier_timeout_evict_missing_fences_straggler(core, clock):
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    run(core.arrive("r", "a", a.incarnation, "x", timeout_s=2, wait_s=0.01))
    advance(core, clock, 1.75, a, b)
    assert core.runs["r"].barriers["x"].result is None
    advance(core, clock, 0.25, a, b)  # the deadline passes while b is alive but absent
    result = run(core.arrive("r", "a", a.incarnation, "x", timeout_s=2))
    assert result.outcome is Outcome.COMPLETED and result.evicted == ["b"] and result.missing == ["b"]
    with pytest.raises(FencedError, match="missed barrier"):
        core.keep_alive("r", "b", b.incarnation)


def test_kv_semantics_match_torch_store(core):
    core.kv_set("r", [(b"k", b"v1")])
    assert core.kv_get("r", [b"k", b"x"]) == ([b"v1", None], [b"x"])
    assert core.kv_compare_set("r", b"k", b"nope", b"v2") == (b"v1", False)
    assert core.kv_compare_set("r", b"k", b"v1", b"v2") == (b"v2", True)
    assert core.kv_compare_set("r", b"new", b"", b"n") == (b"n", True)
    assert core.kv_compare_set("r", b"missing", b"exp", b"d") == (b"exp", False)
    assert core.kv_add("r", b"c", 5) == 5 and core.kv_add("r", b"c", -2) == 3
    with pytest.raises(InvalidRequestError, match="not a decimal integer"):
        core.kv_add("r", b"k", 1)
    for odd in (b"1_0", b"", b"7 "):  # int() takes "1_0" and "7 "
        core.kv_set("r", [(b"odd", odd)])
        with pytest.raises(InvalidRequestError, match="not a decimal integer"):
            core.kv_add("r", b"odd", 1)
    for plain, value in ((b" 7", 8), (b"+3", 4), (b"-0", 1)):  # as TCPStore reads them
        core.kv_set("r", [(b"odd", plain)])
        assert core.kv_add("r", b"odd", 1) == value
    core.kv_delete("r", b"odd")
    assert core.kv_delete("r", b"k") and not core.kv_delete("r", b"k")
    assert core.kv_num_keys("r") == 2  # "new" and "c"


def test_kv_wait_wakes_on_set_and_times_out(core):
    async def scenario():
        waiter = asyncio.create_task(core.kv_wait("r", [b"a", b"b"], 5))
        await asyncio.sleep(0.01)
        core.kv_set("r", [(b"a", b"1")])
        await asyncio.sleep(0.01)
        assert not waiter.done()
        core.kv_set("r", [(b"b", b"2")])
        return await waiter

    assert run(scenario()) == [b"1", b"2"]
    from elasticrl.errors import CoordinatorTimeoutError

    with pytest.raises(CoordinatorTimeoutError, match="not set within"):
        run(core.kv_wait("r", [b"zzz"], 0.05))


def test_limits_are_enforced(clock):
    core = CoordinatorCore(StateDB(None), clock=clock, limits=Limits(max_members_per_run=2, max_kv_bytes_per_run=10))
    core.join("r", "a")
    core.join("r", "b")
    with pytest.raises(ResourceLimitError, match="limit 2"):
        core.join("r", "c")
    with pytest.raises(ResourceLimitError, match="KV bytes"):
        core.kv_set("r", [(b"key", b"01234567")])
    assert core.kv_num_keys("r") == 0


def test_closed_run_refuses_joins_and_rounds(core):
    a, _ = core.join("r", "a")
    core.close_run("r", "done")
    with pytest.raises(RunClosedError, match="closed"):
        core.join("r", "b")
    cfg = RoundConfig(1, 1, 0.1, 10)
    assert run(core.round_join("r", "a", a.incarnation, cfg, after_round=0, wait_s=0.1)).status == "closed"


def test_rounds_form_reform_and_keep_ranks(core, clock):
    cfg = RoundConfig(2, 3, 1.0, 60)
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    c, _ = core.join("r", "c")

    async def scenario():
        ja = asyncio.create_task(core.round_join("r", "a", a.incarnation, cfg, after_round=0, wait_s=5))
        jb = asyncio.create_task(core.round_join("r", "b", b.incarnation, cfg, after_round=0, wait_s=5))
        jc = asyncio.create_task(core.round_join("r", "c", c.incarnation, cfg, after_round=0, wait_s=5))
        return await asyncio.gather(ja, jb, jc)  # max_nodes=3 reached: no last-call wait

    ra, rb, rc = run(scenario())
    assert {ra.round, rb.round, rc.round} == {1} and sorted([ra.rank, rb.rank, rc.rank]) == [0, 1, 2]
    # the rank-0 node dies; the two survivors re-form at once, without a last-call wait
    dead = {ra.rank: "a", rb.rank: "b", rc.rank: "c"}[0]
    clock.now += 0.5
    for m in (a, b, c):
        if m.member_id != dead:
            core.keep_alive("r", m.member_id, m.incarnation)
    clock.now += 0.6
    core.tick()
    assert core.runs["r"].members[dead].status is MemberStatus.EVICTED
    survivors = [m for m in (a, b, c) if m.member_id != dead]

    async def reform():
        return await asyncio.gather(
            *(core.round_join("r", m.member_id, m.incarnation, cfg, after_round=1, wait_s=5) for m in survivors)
        )

    results = run(reform())
    assert all(r.round == 2 and r.world_size == 2 for r in results)
    assert sorted(r.rank for r in results) == [0, 1]


def test_state_survives_reload(tmp_path, clock):
    path = tmp_path / "s.sqlite"
    core = CoordinatorCore(StateDB(path), lease_ttl_s=1.0, clock=clock)
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    core.kv_set("r", [(b"k%d" % i, b"v%d" % i) for i in range(50)])
    assert run(core.arrive("r", "a", a.incarnation, "x", timeout_s=30, wait_s=0.01)) is None
    core.db.close()

    clock.now += 1000.0  # a new process: much later, new clock origin
    again = CoordinatorCore(StateDB(path), lease_ttl_s=1.0, clock=clock)
    r = again.runs["r"]
    assert r.epoch == 2 and r.kv[b"k49"] == b"v49" and len(r.kv) == 50
    assert r.members["a"].live and r.members["a"].lease_deadline == clock.now + 1.0  # grace
    assert r.barriers["x"].arrived == {"a": a.incarnation}
    result = run(again.arrive("r", "b", b.incarnation, "x", timeout_s=30))
    assert result.outcome is Outcome.COMPLETED and result.arrived == ["a", "b"]
    # incarnations keep increasing across restarts
    c, _ = again.join("r", "c")
    assert c.incarnation > b.incarnation


def test_a_broken_stream_evicts_after_the_grace_unless_it_reopens(clock):
    core = CoordinatorCore(StateDB(None), lease_ttl_s=30.0, clock=clock, stream_grace_s=0.5)
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    c, _ = core.join("r", "c")
    for m in (a, b, c):
        core.stream_attached("r", m.member_id, m.incarnation)
    core.stream_detached("r", "a", a.incarnation, abrupt=True)  # a's process died
    core.stream_detached("r", "b", b.incarnation, abrupt=True)  # b's connection blipped...
    clock.now += 0.3
    core.tick()
    core.stream_attached("r", "b", b.incarnation)  # ...and b reopened within the grace
    core.stream_detached("r", "c", c.incarnation, abrupt=False)  # c closed its stream itself
    clock.now += 0.3
    core.tick()
    run = core.runs["r"]
    assert not run.is_live("a", a.incarnation) and "stream broke" in run.members["a"].reason
    assert run.is_live("b", b.incarnation) and run.is_live("c", c.incarnation)  # c: its lease decides
    assert core.metrics.evictions.value(run="r", reason="stream_lost") == 1


def test_a_member_with_another_open_stream_is_not_evicted(clock):
    core = CoordinatorCore(StateDB(None), lease_ttl_s=30.0, clock=clock, stream_grace_s=0.5)
    a, _ = core.join("r", "a")
    core.stream_attached("r", "a", a.incarnation)  # its Session stream
    core.stream_attached("r", "a", a.incarnation)  # and its Work stream
    core.stream_detached("r", "a", a.incarnation, abrupt=True)
    clock.now += 1.0
    core.tick()
    assert core.runs["r"].is_live("a", a.incarnation)


def test_the_live_count_follows_joins_rejoins_leaves_evictions_and_a_restart(clock, tmp_path):
    """``Run.live_count`` is kept up to date per change (counting per join made a join storm
    O(N^2)); it must always equal the live members, also after reloading the state."""
    path = str(tmp_path / "state.sqlite")
    core = CoordinatorCore(StateDB(path), lease_ttl_s=1.0, clock=clock)

    def check(expected: int) -> None:
        run_ = core.runs["r"]
        assert run_.live_count == len(run_.live_members()) == expected

    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    c, _ = core.join("r", "c")
    check(3)
    a, _ = core.join("r", "a")  # a restarted: its old incarnation is replaced, not added
    check(3)
    core.leave("r", "b", b.incarnation)
    check(2)
    advance(core, clock, 1.5, a)  # c's lease lapses
    check(1)
    core.join("r", "b")
    check(2)
    core.db.close()
    reloaded = CoordinatorCore(StateDB(path), lease_ttl_s=1.0, clock=clock)
    assert reloaded.runs["r"].live_count == len(reloaded.runs["r"].live_members()) == 2


def test_time_the_coordinator_could_not_listen_does_not_count_against_leases(core, clock):
    """An overloaded coordinator (a late tick) credits every live lease with the stall: the
    keep-alives it did not read yet must not get their members evicted. A dead member is evicted
    that much later, not earlier."""
    from elasticrl.coordinator import policy

    assert policy.stall_credit(0.06, tick_s=0.05) == 0.0  # an ordinary late tick: no credit
    assert policy.stall_credit(2.6, tick_s=0.05) == 2.6
    a, _ = core.join("r", "a")  # lease until 101.0
    clock.now += 0.9
    core.tick()
    clock.now += 2.6  # the event loop was busy for 2.6 s: a's keep-alives sat unread
    core.tick(stalled_s=2.6)
    assert core.runs["r"].members["a"].live  # its lease now ends at 103.6
    clock.now += 0.2
    core.tick()
    assert core.runs["r"].members["a"].status is MemberStatus.EVICTED


def test_a_stall_pushes_back_barrier_deadlines_too_so_an_unread_arrival_counts(core, clock):
    """A member's arrival sent before a barrier's deadline may sit unread while the coordinator
    stalls past it: the first tick after the stall must not evict it as missing (it did: only
    leases were credited). Without a stall the deadline holds."""
    from elasticrl.coordinator.barriers import Arrival

    a, _ = core.join("r", "a", lease_ttl_s=30.0)
    b, _ = core.join("r", "b", lease_ttl_s=30.0)
    (first,) = core.arrive_many([Arrival("r", "a", a.incarnation, "x", timeout_s=1.0)])
    assert first is None  # waiting for b
    clock.now += 2.0  # the event loop was busy for 2 s; b's arrival (sent at +0.8 s) sat unread
    core.tick(stalled_s=2.0)
    assert core.runs["r"].members["b"].live and core.runs["r"].barriers["x"].result is None
    (second,) = core.arrive_many([Arrival("r", "b", b.incarnation, "x", timeout_s=1.0)])
    assert second.outcome is Outcome.COMPLETED and second.arrived == ["a", "b"] and not second.evicted
    # No stall: a barrier past its deadline evicts the member that did not arrive.
    core.arrive_many([Arrival("r", "a", a.incarnation, "y", timeout_s=1.0)])
    clock.now += 1.1
    core.tick()
    assert core.runs["r"].members["b"].status is MemberStatus.EVICTED


def test_leases_are_scanned_only_once_the_earliest_can_have_expired_and_still_expire_on_time(core, clock):
    a, _ = core.join("r", "a")  # lease until 101.0
    clock.now += 0.5
    core.tick()
    assert core.runs["r"].lease_floor == 101.0
    b, _ = core.join("r", "b", lease_ttl_s=0.2)  # a shorter lease lowers the floor: until 100.7
    assert core.runs["r"].lease_floor == 100.7
    clock.now += 0.3
    core.tick()
    assert core.runs["r"].members["b"].status is MemberStatus.EVICTED and core.runs["r"].members["a"].live
    core.keep_alive("r", "a", a.incarnation)  # until 101.8; the floor (101.0) is only a lower bound
    clock.now += 0.3
    core.tick()  # 101.1: a scan, nothing expired, the floor moves to 101.8
    assert core.runs["r"].members["a"].live and core.runs["r"].lease_floor == pytest.approx(101.8)
    clock.now += 0.75
    core.tick()
    assert core.runs["r"].members["a"].status is MemberStatus.EVICTED


def test_a_barrier_whose_last_arrival_was_stored_but_not_its_decision_is_decided_on_reload(tmp_path, clock):
    """A crash between the commit of a barrier's last arrival and the commit of its decision: after
    the restart every arrival is there, so the members' retried arrivals change nothing. The
    reloaded coordinator must decide the barrier then, not at its timeout (a 120 s hang, found by
    the crash-injection test)."""
    path = tmp_path / "s.sqlite"
    core = CoordinatorCore(StateDB(path), lease_ttl_s=5.0, clock=clock)
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    assert run(core.arrive("r", "a", a.incarnation, "x", timeout_s=120, wait_s=0.01)) is None
    with core.db.tx() as db:  # b's arrival committed; the process died before deciding
        db.put_arrivals([("r", "x", "b", b.incarnation)])
    core.db.close()

    again = CoordinatorCore(StateDB(path), lease_ttl_s=5.0, clock=clock)
    result = run(again.arrive("r", "b", b.incarnation, "x", timeout_s=120, wait_s=0.01))  # b's retry
    assert result is not None and result.outcome is Outcome.COMPLETED and result.arrived == ["a", "b"]
