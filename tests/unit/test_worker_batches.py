"""``RolloutWorker`` cuts the results of tasks that finish together into batches of ``batch_bytes``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from elasticrl.scheduler import framing
from elasticrl.scheduler.state import GroupRecord, SampleRecord, TaskSpec
from elasticrl.scheduler.worker import Assignment, RolloutWorker

pytestmark = pytest.mark.timeout(30)


def run_tasks(w: RolloutWorker, n: int) -> None:
    """``n`` tasks of iteration 1, handed to ``w`` as one assignment message, run to their end."""
    batch = [Assignment(1, TaskSpec(task_id=f"t{i}", prompt_ids=[1]), 10.0, False) for i in range(n)]
    for a in batch:
        w._running[(1, a.task.task_id)] = a

    async def run():
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            await w._run_tasks(executor, batch)

    asyncio.run(asyncio.wait_for(run(), 10))


def test_results_done_together_leave_as_full_batches_at_once_and_the_rest_when_nothing_runs():
    def generate_batch(batch: list[Assignment]) -> list[GroupRecord]:  # 400 bytes of samples a group
        return [GroupRecord(a.task.task_id, "w", 0, 0.0, 0.0, [SampleRecord(b"\0" * 200, b"\0" * 200, 1.0)]) for a in batch]

    w = RolloutWorker("127.0.0.1:1", "r", "w", None, generate_batch=generate_batch, slots=8, batch_bytes=1000)
    run_tasks(w, 8)
    sent = [framing.result_batch_spans(request)[1] for request in w.unacked]
    # A batch goes as soon as it holds batch_bytes (3 groups here), so the coordinator frees those
    # slots while the rest is still being sent; the last 2 go because nothing else runs.
    assert [len(spans) for spans in sent] == [3, 3, 2]
    assert w.stats.batches_sent == 3 and w.stats.completed == 8


class Stopping(Exception):
    stopping = True  # as the node's GateClosed: its engine is stopping, not failing


@pytest.mark.parametrize("error, failed", [(Stopping("the engine worker is stopping"), 0), (RuntimeError("CUDA error"), 2)])
def test_tasks_an_engine_gives_back_while_stopping_are_released_without_an_error(caplog, error, failed):
    # Found by an operator: every in-place re-form logged ERROR "N task(s) failed" with a
    # traceback, for tasks its stopping engine gave back.
    def generate_batch(batch):
        raise error

    w = RolloutWorker("127.0.0.1:1", "r", "w", None, generate_batch=generate_batch, slots=8)
    w._outbox = asyncio.Queue()
    with caplog.at_level("INFO", logger="elasticrl.scheduler.worker"):
        run_tasks(w, 2)
    released = [w._outbox.get_nowait().release.task_ids[0] for _ in range(w._outbox.qsize())]
    assert released == ["t0", "t1"] and not w._running and w.stats.failed == failed
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert (len(errors), bool(errors and errors[0].exc_info)) == ((0, False) if failed == 0 else (1, True))
    if failed == 0:
        assert any("2 task(s) given back: the engine worker is stopping" in r.getMessage() for r in caplog.records)


def test_a_cancelled_run_that_ends_after_its_task_was_handed_out_again_leaves_the_new_copy_running():
    """A copy cancelled (its task done elsewhere) and the same task handed to this worker again
    before the old run ended (a restart lost that result): the old run's end used to untrack the
    new copy by its key, whose result was then dropped as cancelled while the coordinator counted
    its slot until the task lease ran out."""
    release_old = threading.Event()

    def generate_batch(batch: list[Assignment]) -> list[GroupRecord]:
        if batch[0].backup:  # the old copy: ends once the new one is handed out
            release_old.wait(10)
        return [GroupRecord(a.task.task_id, "w", 0, 0.0, 0.0, [SampleRecord(b"\0" * 8, b"\0" * 8, 1.0)]) for a in batch]

    w = RolloutWorker("127.0.0.1:1", "r", "w", None, generate_batch=generate_batch, slots=2)
    old = Assignment(1, TaskSpec(task_id="t0", prompt_ids=[1]), 10.0, True)
    new = Assignment(1, TaskSpec(task_id="t0", prompt_ids=[1]), 10.0, False)

    async def run():
        with concurrent.futures.ThreadPoolExecutor(2) as executor:
            w._running[(1, "t0")] = old
            first = asyncio.ensure_future(w._run_tasks(executor, [old]))
            await asyncio.sleep(0.05)
            del w._running[(1, "t0")]  # cancelled, as the stream's Cancel does
            old.cancelled.set()
            w._running[(1, "t0")] = new  # handed out again
            release_old.set()
            await first
            assert w._running.get((1, "t0")) is new  # the old run's end leaves the new copy tracked
            await w._run_tasks(executor, [new])

    asyncio.run(asyncio.wait_for(run(), 10))
    assert not w._running and w.stats.completed == 1 and len(w.unacked) == 1
