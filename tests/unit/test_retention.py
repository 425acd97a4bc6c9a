"""Issue 15, item 7: what the coordinator keeps is bounded (decided barriers, sealed iterations,
runs, waiter maps), in memory and in SQLite, and survives a restart the same way."""

from __future__ import annotations

import asyncio

import pytest

from elasticrl.coordinator.core import CoordinatorCore, Limits
from elasticrl.coordinator.persist import StateDB
from elasticrl.errors import CoordinatorTimeoutError, NotFoundError, ResourceLimitError
from elasticrl.scheduler.state import IterationConfig, Split

from tests.unit.scheduler_harness import RUN, Harness, assigned, drain, group, specs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rows(core: CoordinatorCore, table: str) -> int:
    return core.db.connection.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def test_only_the_newest_decided_barriers_are_kept_and_reloaded(tmp_path):
    clock = Clock()
    limits = Limits(keep_decided_barriers=5)
    core = CoordinatorCore(StateDB(tmp_path / "s.db"), clock=clock, limits=limits)
    a, _ = core.join("r", "a")

    async def arrive_all():
        for i in range(20):
            await core.arrive("r", "a", a.incarnation, f"b{i}", timeout_s=10)

    asyncio.run(asyncio.wait_for(arrive_all(), 5))
    assert list(core.runs["r"].barriers) == [f"b{i}" for i in range(15, 20)]
    assert rows(core, "barriers") == 5
    core.db.close()  # as a stopped process does
    again = CoordinatorCore(StateDB(tmp_path / "s.db"), clock=clock, limits=limits)
    assert list(again.runs["r"].decided) == [f"b{i}" for i in range(15, 20)]
    result = asyncio.run(asyncio.wait_for(again.arrive("r", "a", a.incarnation, "b19", timeout_s=10), 5))
    assert result.arrived == ["a"]  # a late retry of a kept barrier gets its result again


def test_waiter_maps_are_empty_once_their_waiters_leave():
    core = CoordinatorCore(StateDB(None), clock=Clock())
    a, _ = core.join("r", "a")
    core.join("r", "b")

    async def waits():
        with pytest.raises(CoordinatorTimeoutError):
            await core.kv_wait("r", [b"never"], 0.05)
        assert await core.arrive("r", "a", a.incarnation, "x", timeout_s=60, wait_s=0.05) is None

    asyncio.run(asyncio.wait_for(waits(), 5))
    assert len(core._kv_signals) == 0 and len(core._barrier_signals) == 0


def test_only_the_newest_sealed_iterations_are_kept(tmp_path):
    h = Harness(state_dir=tmp_path)
    h.sched.keep_iterations = 3
    w = h.worker("a", slots=2)
    for i in range(1, 11):
        h.sched.submit(RUN, i, specs(2), IterationConfig())
        ack, _ = h.sched.accept(w, [(i, group(t)) for t in assigned(drain(w))])
        assert ack.accepted == 2 and h.it(i).sealed
        if i == 4:  # the seal is answered first; the next tick drops what it made too old
            assert sorted(h.sched.iterations[RUN]) == [1, 2, 3, 4]
        h.sched.tick()
    assert sorted(h.sched.iterations[RUN]) == [8, 9, 10]
    db = h.coord.db.connection
    assert db.execute("SELECT COUNT(*) FROM sched_iterations").fetchone()[0] == 3
    assert db.execute("SELECT COUNT(DISTINCT iteration) FROM sched_tasks").fetchone()[0] == 3
    assert [r[0] for r in db.execute("SELECT DISTINCT iteration FROM sched_done ORDER BY iteration")] == [8, 9, 10]
    old = h.store.iteration_dir(RUN, 1)
    h.store.settle(5.0)  # the files go in a background thread
    assert not list(old.glob("shard-*")) and (old / "manifest.json").exists()
    with pytest.raises(NotFoundError, match="--keep-iterations"):
        h.sched.shard(RUN, 1, 0, 1, Split.TRAIN)
    assert len(h.sched.shard(RUN, 8, 0, 1, Split.TRAIN)) == 2  # read back from its shard
    h.coord.db.close()  # as a stopped process does
    again = Harness(state_dir=tmp_path, clock=h.clock)
    assert sorted(again.sched.iterations[RUN]) == [8, 9, 10]


def test_a_drop_that_fails_is_tried_again_at_the_next_tick_and_the_tick_goes_on(tmp_path, monkeypatch):
    h = Harness(state_dir=tmp_path)
    h.sched.keep_iterations = 2
    w = h.worker("w", slots=2)
    for i in range(1, 4):
        h.sched.submit(RUN, i, specs(2), IterationConfig())
        if i < 3:
            h.sched.accept(w, [(i, group(t)) for t in assigned(drain(w))])
            h.sched.tick()
    x = h.worker("x", slots=1)
    h.sched.submit(RUN, 4, specs(1), IterationConfig(task_lease_s=1.0))
    assert assigned(drain(x)) == ["t00"]
    h.sched.accept(w, [(3, group(t)) for t in assigned(drain(w))])  # 3 seals: 1 is now too old
    real = h.sched.db.delete_iterations

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(h.sched.db, "delete_iterations", disk_full)
    h.clock.now += 2.0
    h.sched.tick()  # cannot drop 1: it stays whole, and the rest of the tick runs (x's lease on 4's task expired)
    assert sorted(h.sched.iterations[RUN]) == [1, 2, 3, 4] and h.it(1).sealed
    assert h.it(4).tasks["t00"].requeues == 1
    monkeypatch.setattr(h.sched.db, "delete_iterations", real)
    h.sched.tick()
    assert sorted(h.sched.iterations[RUN]) == [2, 3, 4]


def test_the_seal_waiters_map_is_empty_after_a_timed_out_wait():
    h = Harness()
    asyncio.run(asyncio.wait_for(h.sched.wait_sealed(RUN, 7, 0.05), 5))
    assert len(h.sched._seal_signals) == 0


def test_a_new_run_past_max_runs_replaces_a_closed_one_or_is_refused(tmp_path):
    h = Harness(state_dir=tmp_path)
    h.coord.limits = Limits(max_runs=2)
    w = h.worker("a")
    h.sched.submit(RUN, 1, specs(1), IterationConfig())
    h.sched.accept(w, [(1, group(t)) for t in assigned(drain(w))])  # a done task: a sched_done row
    assert h.coord.db.connection.execute("SELECT COUNT(*) FROM sched_done").fetchone()[0] == 1
    h.coord.leave(RUN, "a", h.incarnations["a"])  # a closed run is dropped once no member is live
    h.coord.kv_set("other", [(b"k", b"v")])
    with pytest.raises(ResourceLimitError, match="--max-runs"):
        h.coord.kv_set("third", [(b"k", b"v")])
    h.coord.metrics.joins.inc(run=RUN)
    h.coord.close_run(RUN, "done")
    h.coord.kv_set("third", [(b"k", b"v")])  # the closed run makes room
    assert sorted(h.coord.runs) == ["other", "third"]
    assert RUN not in h.sched.iterations
    assert h.coord.db.connection.execute("SELECT COUNT(*) FROM sched_tasks").fetchone()[0] == 0
    assert h.coord.db.connection.execute("SELECT COUNT(*) FROM sched_done").fetchone()[0] == 0
    assert f'run="{RUN}"' not in h.coord.metrics.render()
