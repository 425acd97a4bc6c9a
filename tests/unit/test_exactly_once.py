"""Issue 15, items 1-4 on an injected clock: retried calls apply once (also across a restart on the
same state), the scheduler changes memory only after its commit, a failed shard write strands
nothing, and any eviction re-decides every open barrier."""

from __future__ import annotations

import asyncio
import errno
import sqlite3

import pytest

from elasticrl.coordinator.core import CoordinatorCore
from elasticrl.coordinator.persist import StateDB
from elasticrl.coordinator.state import Outcome, TimeoutPolicy
from elasticrl.errors import CoordinatorUnavailableError, FencedError, InvalidRequestError
from elasticrl.scheduler.state import IterationConfig, TaskStatus

from tests.unit.scheduler_harness import RUN, Harness, assigned, drain, group, specs


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def restarted(path, clock, crashed: CoordinatorCore | None = None) -> CoordinatorCore:
    """A new core on the same SQLite file: what a coordinator restarted after ``kill -9`` loads.
    ``crashed``'s database is closed first, as a dead process's lock is dropped."""
    if crashed is not None:
        crashed.db.close()
    return CoordinatorCore(StateDB(path), lease_ttl_s=5.0, clock=clock)


# -- item 1: retried calls apply once --------------------------------------------------------


def test_retried_kv_add_after_a_restart_adds_once(tmp_path):
    clock = Clock()
    core = restarted(tmp_path / "s.db", clock)
    assert core.kv_add("r", b"n", 1, request_id="add-1") == 1
    core = restarted(tmp_path / "s.db", clock, core)  # the reply was lost in the crash; the client retries
    assert core.kv_add("r", b"n", 1, request_id="add-1") == 1
    assert core.kv_get("r", [b"n"])[0] == [b"1"]
    assert core.kv_add("r", b"n", 1, request_id="add-2") == 2  # a new call is a new call


def test_retried_compare_set_reports_its_own_swap(tmp_path):
    clock = Clock()
    core = restarted(tmp_path / "s.db", clock)
    assert core.kv_compare_set("r", b"k", b"", b"A", request_id="cas-1") == (b"A", True)
    core = restarted(tmp_path / "s.db", clock, core)
    assert core.kv_compare_set("r", b"k", b"", b"A", request_id="cas-1") == (b"A", True)


def test_a_compare_set_that_failed_does_not_swap_when_retried_later():
    core = CoordinatorCore(StateDB(None), clock=Clock())
    core.kv_set("r", [(b"k", b"X")])
    assert core.kv_compare_set("r", b"k", b"A", b"B", request_id="cas-1") == (b"X", False)
    core.kv_set("r", [(b"k", b"A")])  # someone else makes the expected value current
    assert core.kv_compare_set("r", b"k", b"A", b"B", request_id="cas-1") == (b"X", False)
    assert core.kv_get("r", [b"k"])[0] == [b"A"]


def test_retried_join_and_leave_apply_once(tmp_path):
    clock = Clock()
    core = restarted(tmp_path / "s.db", clock)
    a, epoch = core.join("r", "a", request_id="join-a")
    core = restarted(tmp_path / "s.db", clock, core)
    again, epoch_again = core.join("r", "a", request_id="join-a")
    assert (again.incarnation, epoch_again) == (a.incarnation, epoch)
    assert core.runs["r"].epoch == epoch  # not bumped by the retry, no orphaned incarnation
    assert core.check_member("r", "a", a.incarnation).live
    left = core.leave("r", "a", a.incarnation, request_id="leave-a")
    core = restarted(tmp_path / "s.db", clock, core)
    assert core.leave("r", "a", a.incarnation, request_id="leave-a") == left  # not FencedError


def test_retried_delete_and_set_do_not_apply_twice():
    core = CoordinatorCore(StateDB(None), clock=Clock())
    core.kv_set("r", [(b"k", b"1")], request_id="set-1")
    assert core.kv_delete("r", b"k", request_id="del-1") is True
    core.kv_set("r", [(b"k", b"2")])
    assert core.kv_delete("r", b"k", request_id="del-1") is True  # the replay, not a second delete
    assert core.kv_get("r", [b"k"])[0] == [b"2"]
    core.kv_set("r", [(b"k", b"1")], request_id="set-1")  # a late retry of the first set
    assert core.kv_get("r", [b"k"])[0] == [b"2"]


def test_a_request_id_reused_for_another_call_is_refused():
    core = CoordinatorCore(StateDB(None), clock=Clock())
    core.kv_add("r", b"n", 1, request_id="same")
    with pytest.raises(InvalidRequestError, match="request_id: 'same' was already used for a kv_add"):
        core.kv_set("r", [(b"k", b"v")], request_id="same")


def test_stored_replies_are_bounded(tmp_path):
    core = CoordinatorCore(StateDB(tmp_path / "s.db"), clock=Clock(), keep_request_ids=20)
    for i in range(200):
        core.kv_add("r", b"n", 1, request_id=f"id-{i}")
    assert len(core.replies) <= 22
    rows = core.db.connection.execute("SELECT COUNT(*) FROM replies").fetchone()[0]
    assert rows <= 22
    assert core.kv_add("r", b"n", 1, request_id="id-199") == 200  # recent ids still replay
    assert core.kv_add("r", b"n", 1, request_id="id-0") == 201  # the oldest are forgotten


# -- item 8 (part): writes fenced by an optional member reference -----------------------------


def test_kv_writes_from_a_fenced_member_are_refused_and_anonymous_ones_work():
    core = CoordinatorCore(StateDB(None), clock=Clock())
    a, _ = core.join("r", "a")
    core.kv_set("r", [(b"k", b"1")], writer=("a", a.incarnation))
    core.join("r", "a")  # a restarted: the old incarnation is a zombie now
    for write in (
        lambda w: core.kv_set("r", [(b"k", b"2")], writer=w),
        lambda w: core.kv_add("r", b"n", 1, writer=w),
        lambda w: core.kv_compare_set("r", b"k", b"1", b"3", writer=w),
        lambda w: core.kv_delete("r", b"k", writer=w),
    ):
        with pytest.raises(FencedError):
            write(("a", a.incarnation))
    assert core.kv_get("r", [b"k", b"n"])[0] == [b"1", None]
    core.kv_add("r", b"n", 1)  # a torch Store that is not a member still works
    assert core.kv_get("r", [b"n"])[0] == [b"1"]


# -- item 4: every eviction re-decides every open barrier ---------------------------------------


def test_an_eviction_at_one_barriers_timeout_releases_another_at_once():
    clock = Clock()
    core = CoordinatorCore(StateDB(None), lease_ttl_s=60.0, clock=clock)
    members = {m: core.join("r", m)[0] for m in "abc"}

    async def scenario():
        # "long" waits only for c; "short" evicts c when it times out.
        waits = [
            asyncio.create_task(core.arrive("r", m, members[m].incarnation, "long", timeout_s=600.0))
            for m in "ab"
        ]
        short = [
            asyncio.create_task(core.arrive("r", m, members[m].incarnation, "short", timeout_s=1.0,
                                            policy_=TimeoutPolicy.EVICT_MISSING))
            for m in "ab"
        ]
        await asyncio.sleep(0)
        clock.now += 1.5
        core.tick()
        short_results = await asyncio.wait_for(asyncio.gather(*short), 2)
        assert short_results[0].evicted == ["c"]
        results = await asyncio.wait_for(asyncio.gather(*waits), 2)  # not its own 600 s deadline
        return results

    results = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert all(r.outcome is Outcome.COMPLETED and r.evicted == ["c"] for r in results)
    assert not core.runs["r"].open_barriers


# -- item 2: the scheduler changes memory only after its commit ---------------------------------


def _disk_full(*args, **kwargs):
    raise sqlite3.OperationalError("database or disk is full")


def test_a_failed_commit_of_results_leaves_memory_unchanged(tmp_path, monkeypatch):
    h = Harness(state_dir=tmp_path)
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    w = h.worker("a", slots=2)
    (t0, t1) = assigned(drain(w))
    monkeypatch.setattr(h.sched.db, "put_done", _disk_full)
    with pytest.raises(sqlite3.OperationalError):
        h.sched.accept(w, [(1, group(t0))])
    it = h.it()
    assert it.tasks[t0].status is TaskStatus.RUNNING and t0 not in it.groups
    assert (1, t0) in w.worker.holding and "a" in it.tasks[t0].holders
    assert it.node("a").done == 0 and not it.sealed
    monkeypatch.undo()  # space is back: the same results are stored and the iteration seals
    ack, end = h.sched.accept(w, [(1, group(t0)), (1, group(t1))])
    assert (ack.accepted, ack.refused, end) == (2, [], None)
    assert it.sealed and it.node("a").done == 2


def test_a_failed_seal_commit_leaves_the_iteration_open(tmp_path, monkeypatch):
    h = Harness(state_dir=tmp_path)
    h.sched.submit(RUN, 1, specs(1), IterationConfig())
    w = h.worker("a")
    (t0,) = assigned(drain(w))
    monkeypatch.setattr(h.sched.db, "put_seal", _disk_full)
    with pytest.raises(sqlite3.OperationalError):
        h.sched.accept(w, [(1, group(t0))])
    assert h.it().tasks[t0].status is TaskStatus.DONE  # the result's own commit went through
    assert not h.it().sealed  # but the seal did not: nobody fetches a batch a restart would lose
    monkeypatch.undo()
    h.advance(1.0, alive=("a",))
    assert h.it().sealed


# -- item 3: a failed shard write strands nothing -------------------------------------------------


def test_a_failed_shard_write_keeps_the_tasks_and_the_batch_is_sent_again(tmp_path, monkeypatch):
    h = Harness(state_dir=tmp_path)
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    w = h.worker("a", slots=2)
    (t0, t1) = assigned(drain(w))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(h.store, "write", no_space)
    ack, end = h.sched.accept(w, [(1, group(t0)), (1, group(t1))], "batch-1")
    assert ack is None and isinstance(end, CoordinatorUnavailableError) and "No space" in str(end)
    it = h.it()
    assert all(it.tasks[t].status is TaskStatus.RUNNING for t in (t0, t1))
    # The stream ends on that error: the tasks go back to the queue, nothing is left without a holder.
    h.sched.disconnect(w, str(end))
    assert all(it.tasks[t].status is TaskStatus.QUEUED for t in (t0, t1))
    monkeypatch.undo()
    w2 = h.worker("a", slots=2)  # the worker reopens its stream and sends the batch again
    ack, end = h.sched.accept(w2, [(1, group(t0)), (1, group(t1))], "batch-1")
    assert (ack.accepted, end) == (2, None) and it.sealed


def test_a_resent_batch_gets_its_first_ack_after_a_restart(tmp_path):
    h = Harness(state_dir=tmp_path)
    h.sched.submit(RUN, 1, specs(3), IterationConfig())
    w = h.worker("a", slots=3)
    (t0, t1, t2) = assigned(drain(w))
    first, _ = h.sched.accept(w, [(1, group(t0)), (1, group(t1))], "batch-1")
    h.coord.db.close()
    h2 = Harness(state_dir=tmp_path, clock=h.clock)  # the coordinator restarted before the ack left
    h2.incarnations = dict(h.incarnations)
    w2 = h2.worker("a", slots=3)
    again, end = h2.sched.accept(w2, [(1, group(t0)), (1, group(t1))], "batch-1")
    assert (again.accepted, again.refused, end) == (first.accepted, first.refused, None)
    assert h2.it().counters.refused_duplicate == 0
