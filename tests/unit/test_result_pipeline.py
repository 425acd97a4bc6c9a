"""The pipelined result path (``results.ResultPipeline``) over a real SchedulerCore with a durable
store: shards are written in worker threads while the stream goes on, and still every ack leaves
after its batch's commit, in the order the batches came; a task is stored once even while its
first result is being written; a failed or hung write strands nothing; the batches waiting per
stream are bounded. Writes are held and released by the test, so no timing is guessed."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl.errors import CoordinatorUnavailableError
from elasticrl.scheduler import framing, outbox
from elasticrl.scheduler.results import ResultPipeline
from elasticrl.scheduler.service import SchedulerServicer
from elasticrl.scheduler.state import IterationConfig, TaskStatus
from elasticrl.scheduler.stream import Ack, Assign, End

from tests.unit.scheduler_harness import RUN, Harness, assigned, drain, group, specs

pytestmark = pytest.mark.timeout(30)


class HeldWrites:
    """``SchedulerCore.write`` that waits, per batch id, until the test lets it go (or fails it)."""

    def __init__(self, h: Harness, monkeypatch):
        self.real = h.sched.write
        self.gates: dict[str, threading.Event] = {}
        self.fail: set[str] = set()
        self.written: list[str] = []
        monkeypatch.setattr(h.sched, "write", self.write)

    def hold(self, *batch_ids: str) -> None:
        for b in batch_ids:
            self.gates[b] = threading.Event()

    def release(self, batch_id: str) -> None:
        self.gates[batch_id].set()

    def write(self, d) -> None:
        gate = self.gates.get(d.batch_id)
        if gate is not None and not gate.wait(10):
            raise AssertionError(f"{d.batch_id}: never released")
        if d.batch_id in self.fail:
            raise OSError(28, "No space left on device")
        self.real(d)
        if d.writes:
            self.written.append(d.batch_id)


def record_writers(h: Harness, delay_s=lambda d: 0.0) -> list[str]:
    """Make ``h``'s shard writes take ``delay_s(batch)`` seconds longer; returns the list of the
    names of the threads that wrote, in order, as they write."""
    writers: list[str] = []
    real = h.sched.write

    def write(d):
        writers.append(threading.current_thread().name)
        time.sleep(delay_s(d))
        real(d)

    h.sched.write = write
    return writers


def run(scenario, timeout_s: float = 10.0):
    return asyncio.run(asyncio.wait_for(scenario(), timeout_s))


async def until(condition, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def kinds(messages: list) -> list[str]:
    return [type(m).__name__ for m in messages]


def setup(tmp_path, monkeypatch, n: int = 4, slots: int = 4):
    h = Harness(state_dir=tmp_path)
    h.sched.submit(RUN, 1, specs(n), IterationConfig())
    w = h.worker("a", slots=slots)
    tasks = assigned(drain(w))
    return h, w, tasks, HeldWrites(h, monkeypatch), ResultPipeline(h.sched, store_timeout_s=5.0, threaded_write_bytes=0)


def test_acks_leave_in_arrival_order_after_their_commits_even_when_a_later_write_ends_first(tmp_path, monkeypatch):
    h, w, (t0, t1, t2, t3), writes, pipe = setup(tmp_path, monkeypatch)
    pipe.write_threads = 2  # (one, the default, writes in arrival order anyway)

    async def scenario():
        writes.hold("b1", "b2")
        await pipe.submit(w, [(1, group(t0))], "b1")
        await pipe.submit(w, [(1, group(t1))], "b2")
        writes.release("b2")
        await until(lambda: writes.written == ["b2"], "the second write")
        await asyncio.sleep(0.05)
        assert not [m for m in drain(w) if isinstance(m, Ack)]  # b2 is written, but b1 is not: no ack yet
        assert h.it().tasks[t1].status is TaskStatus.RUNNING  # nor a commit
        writes.release("b1")
        await until(lambda: not w.pending, "both commits")
        acks = [m for m in drain(w) if isinstance(m, Ack)]
        assert [a.accepted for a in acks] == [1, 1]
        assert [h.it().tasks[t].status for t in (t0, t1)] == [TaskStatus.DONE] * 2
        assert h.it().shard_of[t0] < h.it().shard_of[t1]  # named on arrival, in order

    run(scenario)


def test_the_worker_gets_new_tasks_when_its_results_arrive_not_when_they_are_stored(tmp_path, monkeypatch):
    h, w, (t0, t1), writes, pipe = setup(tmp_path, monkeypatch, n=4, slots=2)

    async def scenario():
        writes.hold("b1")
        await pipe.submit(w, [(1, group(t0)), (1, group(t1))], "b1")
        out = drain(w)
        assert kinds(out) == ["Assign"] and assigned(out) == ["t02", "t03"]  # before the ack
        assert w.worker.holding == {(1, "t02"), (1, "t03")}
        assert all(h.it().tasks[t].storing for t in (t0, t1))
        writes.release("b1")
        await until(lambda: not w.pending, "the commit")
        assert kinds(drain(w)) == ["Ack"] and not any(t.storing for t in h.it().tasks.values())

    run(scenario)


def test_a_second_copy_arriving_while_the_first_is_stored_is_refused_as_a_duplicate(tmp_path, monkeypatch):
    h, a, (t0, t1), writes, pipe = setup(tmp_path, monkeypatch, n=2, slots=2)
    b = h.worker("b", slots=1)

    async def scenario():
        writes.hold("from-a")
        await pipe.submit(a, [(1, group(t0))], "from-a")
        await pipe.submit(b, [(1, group(t0, seed=5))], "from-b")  # nothing to write: answered at once
        [ack_b] = [m for m in drain(b) if isinstance(m, Ack)]
        assert (ack_b.accepted, ack_b.refused) == (0, [(1, t0, "duplicate")])
        writes.release("from-a")
        await until(lambda: not a.pending, "a's commit")
        assert h.it().tasks[t0].done_by == "a" and h.it().counters.refused_duplicate == 1
        stored = {g.task_id: g for g, _ in h.store.read_shard(RUN, 1, h.it().shard_of[t0])}
        assert stored[t0].samples == group(t0).samples  # a's copy, not b's

    run(scenario)


def test_a_batch_resent_while_its_first_copy_is_stored_gets_that_copys_ack_counted_once(tmp_path, monkeypatch):
    h, w, (t0, t1), writes, pipe = setup(tmp_path, monkeypatch, n=2, slots=2)

    async def scenario():
        writes.hold("b1")
        await pipe.submit(w, [(1, group(t0)), (1, group(t1))], "b1")
        h.sched.disconnect(w, "connection reset")  # the stream broke before the ack left
        w2 = h.worker("a", slots=2)
        drain(w2)
        await pipe.submit(w2, [(1, group(t0)), (1, group(t1))], "b1")  # the worker sends it again
        assert not [m for m in drain(w2) if isinstance(m, Ack)]  # waits for the first copy
        writes.release("b1")
        await until(lambda: not w2.pending, "the re-sent copy's answer")
        [ack] = [m for m in drain(w2) if isinstance(m, Ack)]
        assert (ack.accepted, ack.refused) == (2, [])
        it = h.it()
        assert it.sealed and it.counters.refused_duplicate == 0 and it.node("a").done == 2
        assert writes.written == ["b1"]  # stored once

    run(scenario)


def test_a_failed_write_ends_the_stream_strands_nothing_and_later_batches_still_commit(tmp_path, monkeypatch):
    h, w, (t0, t1, t2, t3), writes, pipe = setup(tmp_path, monkeypatch)

    async def scenario():
        writes.hold("b1")
        writes.fail.add("b1")
        await pipe.submit(w, [(1, group(t0))], "b1")
        await pipe.submit(w, [(1, group(t1))], "b2")
        writes.release("b1")
        await until(lambda: not w.pending, "both batches")
        out = drain(w)
        end = next(m for m in out if isinstance(m, End))
        assert isinstance(end.error, CoordinatorUnavailableError) and "No space" in str(end.error)
        # b2's ack was queued after the end: the stream never sends it, the worker re-sends b2 and
        # gets it from the replies; b1's task went back to the worker, whose stream end requeues it.
        assert out.index(end) < max(i for i, m in enumerate(out) if isinstance(m, Ack))
        it = h.it()
        assert it.tasks[t1].status is TaskStatus.DONE and it.tasks[t0].status is TaskStatus.RUNNING
        assert (1, t0) in w.worker.holding and not it.tasks[t0].storing
        assert sorted(h.store.shard_names(RUN, 1)) == [it.shard_of[t1]]  # b1's file is gone
        h.sched.disconnect(w, str(end.error))
        assert it.tasks[t0].status is TaskStatus.QUEUED

    run(scenario)


def test_at_most_max_pending_batches_wait_per_stream(tmp_path, monkeypatch):
    h, w, (t0, t1, t2, t3), writes, pipe = setup(tmp_path, monkeypatch)
    pipe.max_pending = 2

    async def scenario():
        writes.hold("b1", "b2", "b3")
        await pipe.submit(w, [(1, group(t0))], "b1")
        await pipe.submit(w, [(1, group(t1))], "b2")
        third = asyncio.ensure_future(pipe.submit(w, [(1, group(t2))], "b3"))
        await asyncio.sleep(0.1)
        assert not third.done() and len(w.pending) == 2  # the stream's next message is not read
        writes.release("b1")
        await asyncio.wait_for(third, 5)
        for b in ("b2", "b3"):
            writes.release(b)
        await until(lambda: not w.pending, "every commit")
        assert [h.it().tasks[t].status for t in (t0, t1, t2)] == [TaskStatus.DONE] * 3

    run(scenario)


def test_a_write_that_hangs_fails_at_its_deadline(tmp_path, monkeypatch):
    h, w, (t0, *_), writes, pipe = setup(tmp_path, monkeypatch)
    pipe.store_timeout_s = 0.3

    async def scenario():
        writes.hold("b1")
        start = time.monotonic()
        await pipe.submit(w, [(1, group(t0))], "b1")
        await until(lambda: not w.pending, "the deadline")
        elapsed = time.monotonic() - start
        [end] = [m for m in drain(w) if isinstance(m, End)]
        assert isinstance(end.error, CoordinatorUnavailableError) and "not stored within 0.3s" in str(end.error)
        assert 0.25 < elapsed < 2.0, elapsed
        assert (1, t0) in w.worker.holding and h.it().tasks[t0].status is TaskStatus.RUNNING
        writes.release("b1")  # the thread finishes later: its file is an orphan, never referenced
        await until(lambda: writes.written == ["b1"], "the late write")
        assert t0 not in h.it().shard_of

    run(scenario)


def test_an_iteration_that_sealed_meanwhile_refuses_the_batch_and_drops_its_shard(tmp_path, monkeypatch):
    h = Harness(state_dir=tmp_path)
    h.sched.submit(RUN, 1, specs(2), IterationConfig(deadline_s=5.0, min_fraction=0.5))
    w = h.worker("a", slots=2)
    t0, t1 = assigned(drain(w))
    writes, pipe = HeldWrites(h, monkeypatch), ResultPipeline(h.sched, store_timeout_s=5.0, threaded_write_bytes=0)

    async def scenario():
        h.sched.accept(w, [(1, group(t0))], "b0")
        writes.hold("b1")
        await pipe.submit(w, [(1, group(t1))], "b1")
        h.advance(6.0, alive=("a",))  # the deadline passes with half done: sealed while b1 is written
        assert h.it().sealed
        writes.release("b1")
        await until(lambda: not w.pending, "the commit")
        [ack] = [m for m in drain(w) if isinstance(m, Ack)]
        assert (ack.accepted, ack.refused) == (0, [(1, t1, "sealed")])
        assert set(h.store.shard_names(RUN, 1)) == {h.it().shard_of[t0]}

    run(scenario)


def test_the_in_memory_store_answers_on_arrival(monkeypatch):
    h = Harness()
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    w = h.worker("a", slots=2)
    t0, t1 = assigned(drain(w))
    pipe = ResultPipeline(h.sched)

    async def scenario():
        await pipe.submit(w, [(1, group(t0)), (1, group(t1))], "b1", [(1, "bad", "invalid: x")])
        assert not w.pending
        [ack] = [m for m in drain(w) if isinstance(m, Ack)]
        assert (ack.accepted, ack.refused) == (2, [(1, "bad", "invalid: x")]) and h.it().sealed

    run(scenario)
    assert not any(isinstance(m, Assign) for m in drain(w))


def test_in_memory_the_tasks_handed_out_on_arrival_reach_the_stream_writer_before_the_commit():
    h = Harness()
    h.sched.submit(RUN, 1, specs(4), IterationConfig())
    w = h.worker("a", slots=2)
    t0, t1 = assigned(drain(w))
    pipe = ResultPipeline(h.sched)
    seen = []

    async def writer():  # the Work stream's writer: what it takes, and what was committed by then
        item = await w.outbox.get()
        seen.append((type(item).__name__, h.it().tasks[t0].status))

    async def scenario():
        reader = asyncio.create_task(writer())
        await pipe.submit(w, [(1, group(t0)), (1, group(t1))], "b1")
        await reader
        assert seen == [("Assign", TaskStatus.RUNNING)]  # sent before the batch committed
        assert not w.pending and h.it().tasks[t0].status is TaskStatus.DONE
        assert [m.accepted for m in drain(w) if isinstance(m, Ack)] == [2]

    run(scenario)


def test_a_combined_acks_worker_gets_its_batchs_ack_and_the_tasks_it_freed_room_for_in_one_message(tmp_path):
    for state_dir in (None, tmp_path):  # in memory, and a small durable batch written on arrival
        h = Harness(state_dir=state_dir)
        h.sched.submit(RUN, 1, specs(4), IterationConfig())
        w = h.worker("a", slots=2)
        w.combined_acks = True
        t0, t1 = assigned(drain(w))
        pipe = ResultPipeline(h.sched)
        messages = []

        async def stream_writer():  # what the Work stream sends, serialized
            messages.append(spb.WorkResponse.FromString(await outbox.Writer(w).next()))

        async def scenario():
            writer = asyncio.create_task(stream_writer())
            await pipe.submit(w, [(1, group(t0)), (1, group(t1))], "b1")
            await writer

        run(scenario)
        [m] = messages
        assert [a.accepted for a in m.acks] == [2] and [t.task.task_id for t in m.assign.tasks] == ["t02", "t03"]
        assert h.it().tasks[t0].status is TaskStatus.DONE and w.outbox.empty()


def test_in_memory_a_stream_that_ends_before_the_commit_strands_nothing():
    h = Harness()
    h.sched.submit(RUN, 1, specs(4), IterationConfig())
    w = h.worker("a", slots=2)
    t0, t1 = assigned(drain(w))
    pipe = ResultPipeline(h.sched)

    async def scenario():
        submit = asyncio.create_task(pipe.submit(w, [(1, group(t0)), (1, group(t1))], "b1"))
        await asyncio.sleep(0)  # decided, waiting for its turn to commit
        assert h.it().tasks[t0].storing and "b1" in h.sched._deciding
        h.sched.disconnect(w, "broken")  # as the Work stream's end does: then its reader is cancelled
        submit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submit

    run(scenario)
    it = h.it()
    assert not any(t.storing for t in it.tasks.values()) and not h.sched._deciding
    assert it.count(TaskStatus.DONE) == 0 and it.count(TaskStatus.QUEUED) == 4  # t0, t1 back in the queue
    assert not [m for m in drain(w) if isinstance(m, Ack)]
    b = h.worker("b", slots=4)  # and handed out again
    assert sorted(assigned(drain(b))) == sorted([t0, t1, "t02", "t03"])


def test_a_small_batch_is_stored_on_arrival_and_a_big_one_in_the_writer_thread(tmp_path):
    h = Harness(state_dir=tmp_path)
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    w = h.worker("a", slots=2)
    t0, t1 = assigned(drain(w))
    pipe = ResultPipeline(h.sched)
    writers = record_writers(h)

    async def scenario():
        await pipe.submit(w, [(1, group(t0))], "small")  # 2 samples x 3 tokens
        assert not w.pending and [m.accepted for m in drain(w) if isinstance(m, Ack)] == [1]
        await pipe.submit(w, [(1, group(t1, tokens=300_000))], "big")  # 4.8 MB of samples
        assert len(w.pending) == 1
        await until(lambda: not w.pending, "the threaded write")
        assert [m.accepted for m in drain(w) if isinstance(m, Ack)] == [1]

    run(scenario)
    assert writers[0] == threading.current_thread().name and writers[1].startswith("shard-write"), writers


def test_after_slow_inline_writes_every_write_goes_to_the_thread_for_a_while(tmp_path):
    h = Harness(state_dir=tmp_path)
    h.sched.submit(RUN, 1, specs(5), IterationConfig())
    w = h.worker("a", slots=5)
    t0, t1, t2, t3, t4 = assigned(drain(w))
    pipe = ResultPipeline(h.sched)
    slow: set[str] = set()
    writers = record_writers(h, lambda d: 0.025 if d.batch_id in slow else 0.0)  # a disk slow for the batches in ``slow``

    async def scenario():
        slow.add("hiccup")
        await pipe.submit(w, [(1, group(t0))], "hiccup")  # small: on the loop, and slow once
        await pipe.submit(w, [(1, group(t1))], "fast")  # one slow write is a hiccup: still on the loop
        assert not w.pending
        pipe._slow_writes.clear()  # long ago
        slow.update({"slow-1", "slow-2", "slow-3"})
        await pipe.submit(w, [(1, group(t2))], "slow-1")
        await pipe.submit(w, [(1, group(t3))], "slow-2")  # the second within the window: the disk is slow
        assert not w.pending
        await pipe.submit(w, [(1, group(t4))], "slow-3")  # so this one goes to the thread
        assert len(w.pending) == 1
        await until(lambda: not w.pending, "the threaded write")
        assert [m.accepted for m in drain(w) if isinstance(m, Ack)] == [1] * 5

    run(scenario)
    main = threading.current_thread().name
    assert writers[:4] == [main] * 4 and writers[4].startswith("shard-write"), writers
    assert h.it().count(TaskStatus.DONE) == 5


def test_writes_slower_than_the_window_send_the_next_one_to_the_thread(tmp_path, monkeypatch):
    from elasticrl.scheduler import results

    monkeypatch.setattr(results, "SLOW_WRITE_WINDOW_S", 0.05)  # each slow write below takes longer than it
    h = Harness(state_dir=tmp_path)
    h.sched.submit(RUN, 1, specs(2), IterationConfig())
    w = h.worker("a", slots=2)
    t0, t1 = assigned(drain(w))
    pipe = ResultPipeline(h.sched)
    writers = record_writers(h, lambda d: 0.06)  # a disk that takes 60 ms per shard

    async def scenario():
        await pipe.submit(w, [(1, group(t0))], "first")  # on the loop; as long as the window: no hiccup
        await pipe.submit(w, [(1, group(t1))], "second")
        await until(lambda: not w.pending, "the threaded write")

    run(scenario)
    assert writers[0] == threading.current_thread().name and writers[1].startswith("shard-write"), writers


def test_with_fsync_every_shard_is_written_in_the_thread(tmp_path):
    h = Harness(state_dir=tmp_path)
    h.store.fsync = True
    h.sched.submit(RUN, 1, specs(1), IterationConfig())
    w = h.worker("a", slots=1)
    (t0,) = assigned(drain(w))
    pipe = ResultPipeline(h.sched)

    async def scenario():
        await pipe.submit(w, [(1, group(t0))], "small")
        assert len(w.pending) == 1  # not committed on arrival: the write is in the thread
        await until(lambda: not w.pending, "the threaded write")
        assert [m.accepted for m in drain(w) if isinstance(m, Ack)] == [1]

    run(scenario)


def test_a_stream_whose_batches_were_not_stored_in_time_ends_unavailable_not_internal(tmp_path, monkeypatch):
    """The reader's wait for room ends in CoordinatorUnavailableError (the oldest batch not stored
    within the deadline): the stream must end with that status, which the worker reconnects after;
    it ended INTERNAL, which a worker takes as fatal."""
    h, w, (t0, *_), _, _ = setup(tmp_path, monkeypatch)
    servicer = SchedulerServicer(h.sched)

    async def no_room(*args, **kwargs):
        raise CoordinatorUnavailableError("results: 4 batches not stored within 60s; send them again")

    monkeypatch.setattr(servicer.results, "submit", no_room)

    async def requests():
        yield framing.result_batch_request([(1, group(t0))], "b1")

    asyncio.run(asyncio.wait_for(servicer._read(w, requests()), 5))
    [end] = [m for m in drain(w) if isinstance(m, End)]
    assert isinstance(end.error, CoordinatorUnavailableError), end.error
