"""Arrivals in groups (``CoordinatorCore.arrive_many``) and the arrivals a Session stream holds
(``session.StreamArrivals``), on a real core with an injected clock: one commit per message, memory
unchanged when the commit fails, one refused arrival alone, a release as one item per stream, and
a durable core deciding exactly as a memory-only one under random messages."""

from __future__ import annotations

import asyncio
import random
import sqlite3

import pytest

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl.coordinator import wire
from elasticrl.coordinator.barriers import Arrival
from elasticrl.coordinator.core import CoordinatorCore, Limits
from elasticrl.coordinator.persist import StateDB
from elasticrl.coordinator.session import Release, StreamArrivals
from elasticrl.coordinator.state import Outcome, TimeoutPolicy
from elasticrl.errors import FencedError, NotFoundError

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def core(clock, tmp_path) -> CoordinatorCore:
    return CoordinatorCore(StateDB(tmp_path / "state.db"), lease_ttl_s=5.0, clock=clock)


def _commits(core: CoordinatorCore) -> list[str]:
    statements: list[str] = []
    core.db.connection.set_trace_callback(statements.append)
    return statements


def test_a_message_of_arrivals_commits_once_and_decides_once(core):
    members = [core.join("r", f"m{i}")[0] for i in range(16)]
    sql = _commits(core)
    results = core.arrive_many([Arrival("r", m.member_id, m.incarnation, "b", timeout_s=10) for m in members])
    # one transaction records the 16 arrivals (and opens the barrier), one decides it
    assert sum(s == "COMMIT" for s in sql) == 2
    assert sum(s.startswith("INSERT OR REPLACE INTO arrivals") for s in sql) == 16
    assert all(r is results[0] for r in results) and results[0].outcome is Outcome.COMPLETED
    assert results[0].arrived == sorted(m.member_id for m in members)


def test_a_failed_commit_changes_nothing_and_fails_every_arrival_it_held(core, monkeypatch):
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    batch = [Arrival("r", "a", a.incarnation, "b", timeout_s=10), Arrival("r", "b", b.incarnation, "b", timeout_s=10)]

    def full(*args):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(core.db, "put_arrivals", full)
    results = core.arrive_many(batch)
    assert [type(r) for r in results] == [sqlite3.OperationalError] * 2
    assert "b" not in core.runs["r"].barriers and not core.runs["r"].open_barriers
    monkeypatch.undo()
    results = core.arrive_many(batch)  # the clients' retry, once there is room
    assert results[0].outcome is Outcome.COMPLETED and results[0].arrived == ["a", "b"]


def test_one_refused_arrival_does_not_refuse_the_others_and_a_repeat_counts_once(core):
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    c, _ = core.join("r", "c")
    sql = _commits(core)
    results = core.arrive_many([
        Arrival("r", "a", a.incarnation, "x", timeout_s=10),
        Arrival("r", "b", b.incarnation + 100, "x", timeout_s=10),  # not b's live incarnation
        Arrival("nope", "a", a.incarnation, "x", timeout_s=10),
        Arrival("r", "a", a.incarnation, "x", timeout_s=10),  # the same arrival twice in one message
        Arrival("r", "c", c.incarnation, "x", timeout_s=10),
    ])
    assert results[0] is None and results[3] is None and results[4] is None  # still waits for b
    assert isinstance(results[1], FencedError) and isinstance(results[2], NotFoundError)
    assert sum(s.startswith("INSERT OR REPLACE INTO arrivals") for s in sql) == 2
    assert core.runs["r"].barriers["x"].arrived == {"a": a.incarnation, "c": c.incarnation}
    (result,) = core.arrive_many([Arrival("r", "b", b.incarnation, "x", timeout_s=10)])
    assert result.arrived == ["a", "b", "c"]


def _arrive(member, name: str, wait_s: float = 10.0) -> pb.ArriveRequest:
    return wire.arrive_request("r", member.member_id, member.incarnation, name,
                               timeout_s=60, policy="evict_missing", epoch=0, wait_s=wait_s)


def _stream(core: CoordinatorCore) -> tuple[StreamArrivals, asyncio.Queue]:
    out: asyncio.Queue = asyncio.Queue(maxsize=64)
    decided = lambda key, result: f"{key[1]}:{','.join(result.arrived)}".encode()  # noqa: E731
    error = lambda request_id, exc: pb.SessionResponse(id=request_id, error=pb.Error(message=str(exc)))  # noqa: E731
    return StreamArrivals(core, out, decided, error), out


def _drain(out: asyncio.Queue) -> list:
    items = []
    while not out.empty():
        items.append(out.get_nowait())
    return items


def test_a_release_puts_one_item_for_every_member_waiting_on_the_stream(core):
    members = [core.join("r", f"m{i}")[0] for i in range(5)]

    async def scenario():
        stream, out = _stream(core)
        await stream.arrive([(i + 1, _arrive(m, "b")) for i, m in enumerate(members[:4])])
        assert stream.count == 4 and out.empty()
        await stream.arrive([(9, _arrive(members[4], "b"))])  # the last one: decided at once
        items = _drain(out)
        assert [type(i) for i in items] == [Release, Release]
        assert items[0].ids == [1, 2, 3, 4] and items[1].ids == [9]  # the waiters, then the last
        assert items[0].wrapped == items[1].wrapped == b"b:m0,m1,m2,m3,m4"
        assert stream.count == 0 and stream.idle.is_set() and len(core._barrier_signals) == 0

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_a_wait_that_runs_out_is_answered_pending_and_the_stream_stops_listening(core):
    a, _ = core.join("r", "a")
    core.join("r", "b")

    async def scenario():
        stream, out = _stream(core)
        await stream.arrive([(1, _arrive(a, "b", wait_s=0.05)), (2, _arrive(a, "other", wait_s=30))])
        await asyncio.sleep(0.2)
        (item,) = _drain(out)
        assert item.id == 1 and item.arrive.outcome == pb.BARRIER_OUTCOME_PENDING
        assert stream.count == 1 and not stream.idle.is_set()
        stream.close()
        assert stream.count == 0 and len(core._barrier_signals) == 0

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_a_member_evicted_while_it_waits_gets_fenced_when_the_barrier_is_decided(core, clock):
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    c, _ = core.join("r", "c")

    async def scenario():
        stream, out = _stream(core)
        await stream.arrive([(1, _arrive(a, "b")), (2, _arrive(b, "b"))])
        core.leave("r", "a", a.incarnation)  # a leaves while it waits; c still blocks the barrier
        assert out.empty()
        await stream.arrive([(3, _arrive(c, "b"))])
        items = _drain(out)
        errors = [i for i in items if isinstance(i, pb.SessionResponse)]
        released = [i for i in items if isinstance(i, Release)]
        assert [e.id for e in errors] == [1] and "left" in errors[0].error.message
        assert sorted(i for r in released for i in r.ids) == [2, 3]

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_a_failed_commit_still_answers_a_repeat_at_a_decided_barrier(core, monkeypatch):
    a, _ = core.join("r", "a")
    (done,) = core.arrive_many([Arrival("r", "a", a.incarnation, "done", timeout_s=10)])
    monkeypatch.setattr(core.db, "put_arrivals", lambda *args: (_ for _ in ()).throw(sqlite3.OperationalError("disk I/O error")))
    again, new = core.arrive_many([Arrival("r", "a", a.incarnation, "done", timeout_s=10),
                                   Arrival("r", "a", a.incarnation, "next", timeout_s=10)])
    assert again is done  # the retry of a decided barrier gets its result, not a wait that never ends
    assert isinstance(new, sqlite3.OperationalError)


def test_answers_parked_for_a_full_queue_count_toward_the_arrivals_bound(core, monkeypatch):
    from elasticrl.coordinator import session

    monkeypatch.setattr(session, "SESSION_MAX_ARRIVALS", 4)
    members = [core.join("r", f"m{i}")[0] for i in range(6)]

    async def scenario():
        stream, out = _stream(core)
        while not out.full():  # a client that does not read
            out.put_nowait(pb.SessionResponse(id=0))
        await stream.arrive([(i + 1, _arrive(m, "b", wait_s=0.01)) for i, m in enumerate(members[:4])])
        await asyncio.sleep(0.1)  # the four waits ran out; their PENDING answers wait for room
        assert stream.count == 0 and len(stream._puts) == 4
        arrive = asyncio.ensure_future(stream.arrive([(9, _arrive(members[4], "c"))]))
        await asyncio.sleep(0)  # the refusal waits for room in ``out`` too
        assert not arrive.done()
        _drain(out)
        await asyncio.wait_for(arrive, 1)
        errors = [i for i in _drain(out) if isinstance(i, pb.SessionResponse) and i.HasField("error")]
        assert [e.id for e in errors] == [9] and "limit 4" in errors[0].error.message
        await asyncio.wait_for(stream.drained(), 1)

    asyncio.run(asyncio.wait_for(scenario(), 5))


def test_a_memory_only_coordinator_decides_barriers_without_barrier_rows(clock):
    """Barrier and arrival rows are read back only by a restart, which memory-only state does not
    survive: they are not written, and an eviction (which is) still reaches the members table."""
    core = CoordinatorCore(StateDB(None), lease_ttl_s=60.0, clock=clock)
    inc = {m: core.join("r", m)[0].incarnation for m in ("a", "b", "c")}
    results = core.arrive_many([Arrival("r", m, inc[m], "x") for m in ("a", "b", "c")])
    assert [r.outcome for r in results] == [Outcome.COMPLETED] * 3
    assert core.arrive_many([Arrival("r", "a", inc["a"], "y", timeout_s=1.0)]) == [None]
    clock.now += 2.0
    core.tick()  # b and c missed y: evicted
    assert core.runs["r"].barriers["y"].result.evicted == ["b", "c"]
    rows = lambda table: core.db.connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # noqa: E731
    assert rows("barriers") == rows("arrivals") == 0
    statuses = dict(core.db.connection.execute("SELECT member_id, status FROM members"))
    assert statuses["b"] == statuses["c"] != statuses["a"]


def test_arrivals_of_many_streams_in_one_turn_of_the_loop_commit_once(core):
    members = [core.join("r", f"m{i}")[0] for i in range(6)]
    sql = _commits(core)

    async def arrive_from_six_streams():
        return await asyncio.gather(*(
            core.arrive_together([Arrival("r", m.member_id, m.incarnation, "b", timeout_s=10)]) for m in members
        ))

    answers = asyncio.run(asyncio.wait_for(arrive_from_six_streams(), 5))
    # one transaction for the six streams' arrivals, one for the decision (was seven and one)
    assert sum(s == "COMMIT" for s in sql) == 2
    assert sum(s.startswith("INSERT OR REPLACE INTO arrivals") for s in sql) == 6
    assert all(len(a) == 1 and a[0].outcome is Outcome.COMPLETED for a in answers)
    assert answers[0][0].arrived == sorted(m.member_id for m in members)


def test_a_refused_arrival_in_a_group_commit_fails_only_its_own_call(core):
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")

    async def arrive():
        return await asyncio.gather(
            core.arrive_together([Arrival("r", "a", a.incarnation, "b", timeout_s=10)]),
            core.arrive_together([Arrival("r", "b", b.incarnation + 1, "b", timeout_s=10)]),  # not its live incarnation
            core.arrive_together([Arrival("r", "b", b.incarnation, "b", timeout_s=10)]),
        )

    first, stale, last = asyncio.run(asyncio.wait_for(arrive(), 5))
    assert isinstance(stale[0], FencedError)
    assert first[0] is last[0] and first[0].outcome is Outcome.COMPLETED and first[0].arrived == ["a", "b"]


def test_in_memory_arrive_together_records_at_once():
    core = CoordinatorCore(StateDB(None), lease_ttl_s=5.0, clock=Clock())
    a, _ = core.join("r", "a")

    async def arrive():
        call = core.arrive_together([Arrival("r", "a", a.incarnation, "b", timeout_s=10)])
        return await call

    (result,) = asyncio.run(asyncio.wait_for(arrive(), 5))
    assert result.outcome is Outcome.COMPLETED


def test_a_new_barrier_ignores_a_not_arrived_set_left_under_its_name(core):
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    core._not_arrived[("r", "x")] = {"ghost"}  # stale: no barrier "x" exists, "ghost" is no member
    (first,) = core.arrive_many([Arrival("r", "a", a.incarnation, "x", timeout_s=10)])
    assert first is None and core._not_arrived[("r", "x")] == {"b"}  # rebuilt for this barrier
    (done,) = core.arrive_many([Arrival("r", "b", b.incarnation, "x", timeout_s=10)])
    assert done.outcome is Outcome.COMPLETED and done.arrived == ["a", "b"] and ("r", "x") not in core._not_arrived


@pytest.mark.parametrize("seed", range(6))
def test_a_durable_core_decides_exactly_as_a_memory_only_one(seed, tmp_path):
    """A durable core writes barrier and arrival rows, a memory-only one skips them: random
    messages (repeats, stale incarnations, several barriers at once, deadlines passed before or
    after a tick, members re-joining, a small keep_decided) must get the same answers and leave
    the same state on both. (It found the double decision of the next test.)"""
    rng = random.Random(seed)
    clocks = [Clock(), Clock()]
    cores = [CoordinatorCore(StateDB(db), lease_ttl_s=1e6, clock=c, limits=Limits(keep_decided_barriers=4))
             for db, c in zip((tmp_path / "state.db", None), clocks)]
    names = [f"b{i}" for i in range(6)]
    for step in range(300):
        roll = rng.random()
        if roll < 0.1:  # a member joins (or re-joins: a new incarnation)
            m = f"m{rng.randrange(10)}"
            assert len({core.join("r", m)[0].incarnation for core in cores}) == 1
            continue
        if roll < 0.15:
            step_s = rng.choice((1.0, 6.0))
            for c in clocks:
                c.now += step_s
            if rng.random() < 0.5:  # else the next message comes past a deadline before any tick
                for core in cores:
                    core.tick()
            continue
        members = cores[0].runs["r"].members if "r" in cores[0].runs else {}
        batch = []
        for _ in range(rng.randrange(1, 8)):
            if not members:
                break
            m = rng.choice(sorted(members))
            inc = members[m].incarnation - (1 if rng.random() < 0.05 else 0)
            policy_ = rng.choice((TimeoutPolicy.EVICT_MISSING, TimeoutPolicy.REPORT))
            batch.append(Arrival("r", m, inc, rng.choice(names), timeout_s=5.0, policy=policy_))
        answers = [core.arrive_many(list(batch)) for core in cores]
        shown = [[type(r).__name__ if isinstance(r, Exception) else r for r in a] for a in answers]
        assert shown[0] == shown[1], f"step {step}"
        runs = [core.runs.get("r") for core in cores]
        if runs[0] is not None:
            assert list(runs[0].decided) == list(runs[1].decided), f"step {step}"
            assert {n: (b.result, b.arrived) for n, b in runs[0].barriers.items()} == \
                {n: (b.result, b.arrived) for n, b in runs[1].barriers.items()}, f"step {step}"
            assert {m: (x.status, x.incarnation) for m, x in runs[0].members.items()} == \
                {m: (x.status, x.incarnation) for m, x in runs[1].members.items()}, f"step {step}"
            assert runs[0].epoch == runs[1].epoch


def test_a_tick_does_not_decide_again_a_barrier_that_an_eviction_decided(core, clock):
    a, _ = core.join("r", "a")
    b, _ = core.join("r", "b")
    for name in ("x", "y"):
        core.arrive_many([Arrival("r", "a", a.incarnation, name, timeout_s=1)])
    clock.now += 2
    core.keep_alive("r", "a", a.incarnation)
    core.keep_alive("r", "b", b.incarnation)
    core.tick()  # x evicts b, which decides y at once; the tick then comes to y, already decided
    run = core.runs["r"]
    assert list(run.decided) == ["x", "y"]  # was ["x", "y", "y"]: y applied twice
    assert run.barriers["x"].result.evicted == ["b"] and run.barriers["y"].result.outcome is Outcome.COMPLETED


def test_a_unary_arrival_whose_barrier_is_decided_before_it_resumes_gets_the_result(core, clock):
    """A durable core answers a group commit at the end of the loop's turn; a tick (or a join, a
    leave) before the caller resumes may decide the barrier and fire its waiters already. The
    caller then waited for a fire that had come: with wait_s 0 (until decided) for good."""
    a, _ = core.join("r", "a")
    core.join("r", "b")

    async def scenario():
        call = asyncio.ensure_future(core.arrive("r", "a", a.incarnation, "x", timeout_s=1, wait_s=0))
        while "x" not in core.runs["r"].barriers:  # the group commit ran: a is recorded at x ...
            await asyncio.sleep(0)
        assert not call.done()  # ... and its answer (None: wait) has not reached the caller yet
        clock.now += 2.0
        core.keep_alive("r", "a", a.incarnation)
        core.tick()  # b missed x: evicted, x decided
        return await asyncio.wait_for(call, 2)

    result = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert result.outcome is Outcome.COMPLETED and result.arrived == ["a"] and result.evicted == ["b"]


def test_an_arrival_is_answered_from_its_barrier_even_if_the_same_call_drops_it(clock, tmp_path):
    core = CoordinatorCore(StateDB(tmp_path / "state.db"), lease_ttl_s=60.0, clock=clock, limits=Limits(keep_decided_barriers=1))
    a, _ = core.join("r", "a")
    core.arrive_many([Arrival("r", "a", a.incarnation, "old")])
    # x decided, then y decided, which pushes x out (keep 1)
    results = core.arrive_many([Arrival("r", "a", a.incarnation, n) for n in ("x", "y")])
    assert [r.outcome for r in results] == [Outcome.COMPLETED] * 2  # x's was None: a caller waited for good
    assert list(core.runs["r"].decided) == ["y"]
