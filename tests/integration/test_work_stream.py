"""A raw Work stream against a real coordinator subprocess: what a worker sends that the
coordinator cannot act on fails alone and never ends the stream."""

from __future__ import annotations

import array
import asyncio

import pytest

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl._proto import scheduler_pb2_grpc as spb_grpc
from elasticrl.coordinator import wire
from elasticrl.coordinator.aio_client import AsyncCoordinatorClient
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.scheduler.state import TaskSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _result(iteration: int, task_id: str) -> spb.WorkRequest:
    tokens = array.array("i", [5, 6, 7]).tobytes()
    logprobs = array.array("f", [-0.5, -0.5, -0.5]).tobytes()
    sample = spb.Sample(completion_ids=tokens, logprobs=logprobs, reward=1.0, finish_reason="stop")
    group = spb.TrajectoryGroup(iteration=iteration, task_id=task_id, samples=[sample])
    return spb.WorkRequest(results=spb.ResultBatch(groups=[group], batch_id=f"batch-{task_id}"))


def test_release_of_an_unknown_iteration_is_ignored_and_the_stream_goes_on(coordinator):
    """A release naming an iteration the coordinator does not hold (retention dropped it, say)
    used to end the worker's stream with INTERNAL."""
    run = "work-unknown"
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        client.submit_iteration(run, 1, [TaskSpec(task_id=f"t{i}", prompt_ids=[1, 2], num_samples=1) for i in range(2)])

    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as c:
            joined = await c.join(run, "w0", lease_ttl_s=60)
            call = spb_grpc.SchedulerStub(c._channel).Work()
            hello = spb.WorkerHello(run_id=run, member=wire.member_ref("w0", joined.incarnation), slots=1)
            await call.write(spb.WorkRequest(hello=hello))
            first = await asyncio.wait_for(call.read(), 10)
            assert first.WhichOneof("kind") == "assign", first
            task_id = first.assign.tasks[0].task.task_id
            await call.write(spb.WorkRequest(release=spb.ReleaseTasks(iteration=999, task_ids=[task_id], reason="x")))
            await call.write(_result(1, task_id))  # the stream is still open: the result is taken
            messages = []
            while not any(m.WhichOneof("kind") == "ack" for m in messages):
                messages.append(await asyncio.wait_for(call.read(), 10))
            ack = next(m.ack for m in messages if m.WhichOneof("kind") == "ack")
            assert ack.accepted == 1 and not ack.refused, ack
            call.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    log = coordinator.log()
    assert "iteration 999, which this coordinator does not hold; ignored" in log, log[-2000:]
    assert "work stream of w0 failed" not in log
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        status = client.iteration_status(run, 1)
    assert status["tasks_done"] == 1, status
