"""A raw Work stream against a real coordinator subprocess: what a worker sends that the
coordinator cannot act on fails alone and never ends the stream, and a reopened stream's hello
gets back the tasks the worker still runs."""

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


def test_a_reopened_stream_holds_the_tasks_its_hello_says_still_run_and_refuses_an_overlong_list(coordinator):
    """A worker whose stream broke still runs what the old one handed it; its new hello names
    those tasks, and the coordinator, which queued them again when the old stream ended, holds
    them for it instead of handing them out anew. A list longer than any engine's slots is
    refused, naming the field."""
    import grpc

    run = "work-running"
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        client.submit_iteration(run, 1, [TaskSpec(task_id=f"t{i}", prompt_ids=[1, 2], num_samples=1) for i in range(3)])

    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as c:
            joined = await c.join(run, "w0", lease_ttl_s=60)
            stub = spb_grpc.SchedulerStub(c._channel)
            hello = spb.WorkerHello(run_id=run, member=wire.member_ref("w0", joined.incarnation), slots=1)
            call = stub.Work()
            await call.write(spb.WorkRequest(hello=hello))
            first = await asyncio.wait_for(call.read(), 10)
            task_id = first.assign.tasks[0].task.task_id
            call.cancel()  # the stream breaks; the engine goes on with task_id
            deadline = asyncio.get_running_loop().time() + 10
            while "worker w0 disconnected" not in coordinator.log():  # task_id is queued again
                assert asyncio.get_running_loop().time() < deadline, coordinator.log()[-2000:]
                await asyncio.sleep(0.02)
            hello.running.add(iteration=1, task_ids=[task_id])
            hello.reports_running = True
            call = stub.Work()
            await call.write(spb.WorkRequest(hello=hello))
            await call.write(_result(1, task_id))
            messages = []
            while not ({"assign", "ack"} <= {m.WhichOneof("kind") for m in messages}):  # the ack, and the slot it freed
                messages.append(await asyncio.wait_for(call.read(), 10))
            handed = [t.task.task_id for m in messages for t in m.assign.tasks]
            acks = [m.ack.accepted for m in messages if m.WhichOneof("kind") == "ack"]
            assert task_id not in handed and len(handed) == 1 and acks == [1], messages
            call.cancel()
            too_many = spb.WorkerHello(run_id=run, member=wire.member_ref("w0", joined.incarnation), slots=1)
            too_many.running.add(iteration=1, task_ids=[f"x{i}" for i in range(5000)])
            call = stub.Work()
            await call.write(spb.WorkRequest(hello=too_many))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call.read(), 10)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "hello.running" in err.value.details()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert "still runs 1 task(s): 1 held for it again, 0 cancelled" in coordinator.log()
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        status = client.iteration_status(run, 1)
    assert status["tasks_done"] == 1, status


def test_result_batches_are_read_in_place_and_what_is_wrong_with_one_group_fails_that_group(coordinator):
    """The coordinator reads result batches from the bytes received (scheduler.framing): a group
    with an unacceptable value is refused as invalid while the batch's other groups are stored, a
    group carrying fields only the coordinator fills is stored without them (the trainer gets the
    coordinator's node and prompt), and bytes that are not a message end the stream with
    INVALID_ARGUMENT."""
    import grpc

    run = "work-framing"
    specs = [TaskSpec(task_id=f"t{i}", prompt_ids=[10 + i, 2], num_samples=1) for i in range(3)]
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        client.submit_iteration(run, 1, specs)

    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as c:
            joined = await c.join(run, "w0", lease_ttl_s=60)
            call = spb_grpc.SchedulerStub(c._channel).Work()
            hello = spb.WorkerHello(run_id=run, member=wire.member_ref("w0", joined.incarnation), slots=3)
            await call.write(spb.WorkRequest(hello=hello))
            first = await asyncio.wait_for(call.read(), 10)
            assert sorted(a.task.task_id for a in first.assign.tasks) == ["t0", "t1", "t2"], first
            batch = _result(1, "t0")
            forged = batch.results.groups.add()
            forged.CopyFrom(_result(1, "t1").results.groups[0])
            forged.node, forged.metadata_json = "someone-else", '{"forged": true}'
            forged.prompt_ids.extend([666])
            bad = batch.results.groups.add()
            bad.CopyFrom(_result(1, "t2").results.groups[0])
            bad.samples[0].logprobs = b"\x00" * 4  # 1 logprob for 3 tokens
            await call.write(batch)
            ack = None
            while ack is None:
                m = await asyncio.wait_for(call.read(), 10)
                ack = m.ack if m.WhichOneof("kind") == "ack" else None
            assert ack.accepted == 2 and [(r.task_id, r.reason.split(":")[0]) for r in ack.refused] == [("t2", "invalid")], ack
            await call.write(_result(1, "t2"))  # sent right: taken
            ack = None
            while ack is None:
                m = await asyncio.wait_for(call.read(), 10)
                ack = m.ack if m.WhichOneof("kind") == "ack" else None
            assert ack.accepted == 1, ack
            # 3 of the 4 bytes its length says: not a message
            raw = c._channel.stream_stream("/elasticrl.v1.Scheduler/Work", request_serializer=None, response_deserializer=None)
            broken = raw()
            await broken.write(spb.WorkRequest(hello=hello).SerializeToString())
            await broken.write(b"\x12\x04\x0a\x02\x08")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:
                    await asyncio.wait_for(broken.read(), 10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "WorkRequest" in err.value.details()
            call.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        assert client.wait_sealed(run, 1, timeout_s=10)["tasks_done"] == 3
        fetched = {g.task_id: g for g in client.fetch_shard(run, 1, rank=0, world_size=1)}
    assert sorted(fetched) == ["t0", "t1", "t2"]
    g = fetched["t1"]
    assert (g.node, g.prompt_ids, g.metadata_json) == ("w0", [11, 2], ""), g
    assert g.samples[0].token_ids() == [5, 6, 7] and g.samples[0].reward == 1.0


def test_results_in_a_form_protobuf_merges_are_taken(coordinator):
    """Results that ``framing.result_batch_spans`` leaves to protobuf (here an unknown field
    beside them, as a newer worker may send) are read from the parsed message; they were refused
    as "kind: results is not allowed after the hello"."""
    run = "work-merged"
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        client.submit_iteration(run, 1, [TaskSpec(task_id="t0", prompt_ids=[1, 2], num_samples=1)])

    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as c:
            joined = await c.join(run, "w0", lease_ttl_s=60)
            raw = c._channel.stream_stream("/elasticrl.v1.Scheduler/Work", request_serializer=None, response_deserializer=None)
            call = raw()
            hello = spb.WorkerHello(run_id=run, member=wire.member_ref("w0", joined.incarnation), slots=1)
            await call.write(spb.WorkRequest(hello=hello).SerializeToString())
            first = spb.WorkResponse.FromString(await asyncio.wait_for(call.read(), 10))
            assert first.WhichOneof("kind") == "assign", first
            await call.write(_result(1, "t0").SerializeToString() + b"\xa0\x01\x01")  # + unknown field 20
            ack = None
            while ack is None:
                m = spb.WorkResponse.FromString(await asyncio.wait_for(call.read(), 10))
                ack = m.ack if m.WhichOneof("kind") == "ack" else None
            assert ack.accepted == 1 and not ack.refused, ack
            call.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        assert client.wait_sealed(run, 1, timeout_s=10)["tasks_done"] == 1


def test_a_copy_skipped_by_a_worker_holding_its_result_is_given_back_after_the_resent_batch_s_ack(coordinator):
    """A coordinator killed after storing a result and before its ack reached the worker, whose
    shard file is lost (a rename that never reached the disk): the restarted coordinator queues the
    task again and hands it to the same worker on its hello. The worker holds the result (its ack
    never came) and skips that copy (``RolloutWorker._has``), then re-sends the batch. Its first ack
    comes back, and the skipped copy is given back: the task is handed out again after that ack on
    the wire, so the worker runs it. Before, the copy held the worker's slot and the task until the
    task lease ran out (600 s by default)."""
    run = "work-handed-again"
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        client.submit_iteration(run, 1, [TaskSpec(task_id=f"t{i}", prompt_ids=[1, 2], num_samples=1) for i in range(2)])

    def acks(m) -> list:
        return [m.ack] if m.WhichOneof("kind") == "ack" else list(m.acks)

    def handed(m) -> list[str]:
        return [a.task.task_id for a in m.assign.tasks]

    async def read(call, messages: list, until) -> None:
        """Read into ``messages`` until one read now satisfies ``until``."""
        while True:
            messages.append(await asyncio.wait_for(call.read(), 10))
            if until(messages[-1]):
                return

    async def first_stream() -> int:
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as c:
            joined = await c.join(run, "w0", lease_ttl_s=120)
            call = spb_grpc.SchedulerStub(c._channel).Work()
            hello = spb.WorkerHello(run_id=run, member=wire.member_ref("w0", joined.incarnation), slots=1,
                                    reports_running=True)
            await call.write(spb.WorkRequest(hello=hello))
            messages: list = []
            await read(call, messages, lambda m: handed(m) == ["t0"])
            await call.write(_result(1, "t0"))
            await read(call, messages, acks)  # stored; as far as the worker knows, the ack is lost
            call.cancel()  # (t1, handed out with the ack, is not run: the iteration stays open)
            return joined.incarnation

    incarnation = asyncio.run(asyncio.wait_for(first_stream(), 30))
    coordinator.kill()
    shards = list((coordinator.state_dir / "trajectories" / run).rglob("shard-*.safetensors"))
    assert len(shards) == 1, shards
    shards[0].unlink()
    coordinator.start()

    async def after_restart() -> list:
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=5) as c:
            call = spb_grpc.SchedulerStub(c._channel).Work()
            hello = spb.WorkerHello(run_id=run, member=wire.member_ref("w0", incarnation), slots=1, reports_running=True)
            await call.write(spb.WorkRequest(hello=hello))
            messages: list = []
            await read(call, messages, lambda m: "t0" in handed(m))  # skipped: the worker holds its result
            await call.write(_result(1, "t0"))  # the batch whose ack it never got
            await read(call, messages, acks)
            if "t0" not in handed(messages[-1]):
                await read(call, messages, lambda m: "t0" in handed(m))  # the copy given back, handed out again
            since = len(messages)
            for task_id in ("t0", "t1"):  # the worker runs t0 now, then t1 (handed out on t0's result)
                if not any(task_id in handed(m) for m in messages[since - 1:]):
                    await read(call, messages, lambda m: task_id in handed(m))
                batch = _result(1, task_id)
                batch.results.batch_id = f"again-{task_id}"
                await call.write(batch)
                await read(call, messages, acks)
            call.cancel()
            return messages

    messages = asyncio.run(asyncio.wait_for(after_restart(), 30))
    trace = [(handed(m), [a.accepted for a in acks(m)]) for m in messages]
    first_ack = next(i for i, m in enumerate(messages) if acks(m))
    again = [i for i, m in enumerate(messages) if "t0" in handed(m)][1]
    # After the ack (a merged message carries its acks first): the worker drops the result, then runs t0.
    assert first_ack <= again, trace
    assert acks(messages[first_ack])[0].accepted == 1, trace  # its first answer
    assert "handed to it again meanwhile, which it skipped; given back" in coordinator.log()
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        assert client.wait_sealed(run, 1, timeout_s=10)["tasks_done"] == 2
