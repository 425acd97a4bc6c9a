"""``RolloutWorker`` cuts the results of tasks that finish together into batches of ``batch_bytes``."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from elasticrl.scheduler import framing
from elasticrl.scheduler.state import GroupRecord, SampleRecord, TaskSpec
from elasticrl.scheduler.worker import Assignment, RolloutWorker

pytestmark = pytest.mark.timeout(30)


def test_results_done_together_leave_as_full_batches_at_once_and_the_rest_when_nothing_runs():
    def generate_batch(batch: list[Assignment]) -> list[GroupRecord]:  # 400 bytes of samples a group
        return [GroupRecord(a.task.task_id, "w", 0, 0.0, 0.0, [SampleRecord(b"\0" * 200, b"\0" * 200, 1.0)]) for a in batch]

    w = RolloutWorker("127.0.0.1:1", "r", "w", None, generate_batch=generate_batch, slots=8, batch_bytes=1000)
    batch = [Assignment(1, TaskSpec(task_id=f"t{i}", prompt_ids=[1]), 10.0, False) for i in range(8)]
    for a in batch:
        w._running[(1, a.task.task_id)] = a

    async def run():
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            await w._run_tasks(executor, batch)

    asyncio.run(asyncio.wait_for(run(), 10))
    sent = [framing.result_batch_spans(request)[1] for request in w.unacked]
    # A batch goes as soon as it holds batch_bytes (3 groups here), so the coordinator frees those
    # slots while the rest is still being sent; the last 2 go because nothing else runs.
    assert [len(spans) for spans in sent] == [3, 3, 2]
    assert w.stats.batches_sent == 3 and w.stats.completed == 8
