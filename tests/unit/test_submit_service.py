"""``SubmitIteration`` at the servicer: a big submit converts its tasks in a thread, so the event
loop (every stream, barrier and keep-alive) is not held for all of them, and a bad task is still
refused with its field named; a small one converts on the loop (no hand-off)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl.scheduler import service
from elasticrl.scheduler.service import SchedulerServicer

from tests.unit.scheduler_harness import RUN, Harness

pytestmark = pytest.mark.timeout(60)


class Aborted(Exception):
    pass


class Context:
    code = details = None

    async def abort(self, code, details, trailing_metadata=()):
        self.code, self.details = code, details
        raise Aborted()


def request(n: int, iteration: int, *, bad: int | None = None) -> spb.SubmitIterationRequest:
    r = spb.SubmitIterationRequest(run_id=RUN, iteration=iteration)
    for k in range(n):
        r.tasks.add(task_id=f"t{k:05d}", num_samples=2, prompt_ids=[1, 2, 3])
    if bad is not None:
        r.tasks[bad].num_samples = 0
    return r


def test_a_big_submit_converts_its_tasks_off_the_event_loop_and_still_names_a_bad_one(monkeypatch):
    h = Harness()
    servicer = SchedulerServicer(h.sched)
    threads: list[threading.Thread] = []
    real = service.task_from_pb

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(service, "task_from_pb", recording)
    big = service.THREADED_SUBMIT_TASKS

    async def scenario():
        loop_thread = threading.current_thread()
        reply = await servicer.SubmitIteration(request(big, 1), Context())
        assert reply.created and reply.num_tasks == big
        assert len(threads) == big and all(t is not loop_thread for t in threads)
        threads.clear()
        await servicer.SubmitIteration(request(3, 2), Context())
        assert threads == [loop_thread] * 3
        ctx = Context()
        with pytest.raises(Aborted):
            await servicer.SubmitIteration(request(big, 3, bad=big - 1), ctx)
        assert ctx.code is grpc.StatusCode.INVALID_ARGUMENT and f"tasks[{big - 1}].num_samples" in ctx.details

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert sorted(h.sched.iterations[RUN]) == [1, 2]  # the refused submit left nothing
    assert h.it(1).tasks["t00000"].spec._wire == request(1, 1).tasks[0].SerializeToString()


def test_a_submitted_tasks_unknown_fields_are_neither_stored_nor_handed_out():
    h = Harness(state_dir=None)
    servicer = SchedulerServicer(h.sched)
    r = request(1, 1)
    extra = b"\xc2\x3e\x05hello"  # field 1000, length-delimited: not in TaskSpec
    r.tasks[0].MergeFromString(extra)
    assert extra in r.tasks[0].SerializeToString()
    asyncio.run(asyncio.wait_for(servicer.SubmitIteration(r, Context()), 10))
    wire = h.it(1).tasks["t00000"].spec._wire
    assert extra not in wire and wire == request(1, 1).tasks[0].SerializeToString()


def test_the_coordinators_copy_of_a_submitted_spec_is_compact_and_a_workers_is_plain():
    import array
    import gc

    from elasticrl.scheduler.convert import task_from_pb, task_wire

    same = [task_from_pb(f"tasks[{i}]", t, keep_wire=True) for i, t in enumerate(request(2, 1).tasks)]
    other = spb.TaskSpec(task_id="t9", num_samples=2, prompt_ids=[1, 2, 3], sampling=spb.SamplingParams(seed=7))
    seeded = task_from_pb("tasks[2]", other, keep_wire=True)
    # the coordinator's: an int32 array, one Sampling per distinct value, the message an attribute
    assert isinstance(same[0].prompt_ids, array.array) and list(same[0].prompt_ids) == [1, 2, 3]
    assert same[0].sampling is same[1].sampling and seeded.sampling is not same[0].sampling and seeded.sampling.seed == 7
    assert not any(isinstance(r, dict) for r in gc.get_referents(same[0]))  # no instance dict: one object fewer to track
    assert spb.TaskSpec.FromString(task_wire(same[0])).prompt_ids == [1, 2, 3]
    # a worker's (no keep_wire): plain lists, its own Sampling, which an engine may change
    plain = [task_from_pb(f"tasks[{i}]", t) for i, t in enumerate(request(2, 1).tasks)]
    assert plain[0].prompt_ids == [1, 2, 3] and plain[0].sampling is not plain[1].sampling
