"""What ``RolloutWorker``'s hello says it still runs (``WorkerHello.running``) against what it
then runs and reports, through a fake Work call (no coordinator): the coordinator holds every task
the hello names for this worker, so the worker must run or release each of them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl.scheduler.convert import task_wire
from elasticrl.scheduler.state import WORK_FEATURES, TaskFailure, TaskSpec
from elasticrl.scheduler.worker import RolloutWorker

pytestmark = pytest.mark.timeout(30)


class FakeCall:
    """A Work call that records what the worker sends; it is up once ``opened`` is set (its
    initial metadata waits for it, as a reconnect waits a round trip or more) and ends on cancel."""

    def __init__(self, requests, opened: asyncio.Event, sent: list, features: str):
        self.opened, self.sent, self.ended, self.features = opened, sent, asyncio.Event(), features
        self.pump = asyncio.ensure_future(self._take(requests))

    async def _take(self, requests):
        async for r in requests:
            self.sent.append(r if isinstance(r, spb.WorkRequest) else spb.WorkRequest.FromString(r))

    async def initial_metadata(self):
        await self.opened.wait()
        return ((WORK_FEATURES[0], self.features),)

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        self.ended.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self.ended.wait()
        raise StopAsyncIteration


class FakeClient:
    call_timeout_s = 5.0
    _metadata = ()

    def __init__(self, opened: asyncio.Event, sent: list, features: str):
        class Channel:
            def stream_stream(self, *args, **kwargs):
                return lambda requests, metadata=None: FakeCall(requests, opened, sent, features)

        self._channel = Channel()


def assignment(task_id: str, iteration: int = 1) -> spb.TaskAssignment:
    a = spb.TaskAssignment(iteration=iteration, lease_ms=600_000)
    a.task.ParseFromString(task_wire(TaskSpec(task_id=task_id, prompt_ids=[1, 2], num_samples=1)))
    return a


def named(hello: spb.WorkerHello) -> list[tuple[int, list[str]]]:
    return [(k.iteration, list(k.task_ids)) for k in hello.running]


def worker_with(generate_batch, opened: asyncio.Event, sent: list, features: str = WORK_FEATURES[1]) -> RolloutWorker:
    """``features``: what the coordinator says it reads (an older one: "renew", or nothing)."""
    w = RolloutWorker("unused:1", "r", "w0", None, generate_batch=generate_batch, slots=3)
    w._client = FakeClient(opened, sent, features)
    return w


def test_the_hello_names_what_runs_by_iteration_and_says_it_reports_them():
    go = threading.Event()

    async def scenario():
        opened, sent = asyncio.Event(), []
        opened.set()
        w = worker_with(lambda batch: go.wait(5) and [], opened, sent)
        with concurrent.futures.ThreadPoolExecutor(2) as executor:
            w._start(executor, [assignment("b", 2), assignment("a", 1), assignment("c", 2)])
            stream = asyncio.create_task(w._one_stream(executor))
            await asyncio.sleep(0.05)
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
            go.set()
        return sent

    hello = asyncio.run(asyncio.wait_for(scenario(), 10))[0].hello
    assert hello.reports_running and named(hello) == [(1, ["a"]), (2, ["b", "c"])]


@pytest.mark.parametrize("features", [WORK_FEATURES[1], "renew"])
def test_a_release_made_while_the_new_stream_opens_goes_on_it_after_the_hello(features):
    # The hello (naming t0) is built before the stream is up; the env fails t0 meanwhile. Dropped,
    # the release left t0 held for this worker, which no longer ran it, for a whole task lease.
    # An older coordinator ("renew" only) ignores the hello's list: it queued t0 again and may have
    # handed it out anew on this stream, whose slot the release would free, so it gets none.
    go = threading.Event()

    def generate_batch(batch):
        go.wait(5)
        return [TaskFailure(a.task.task_id, "env raised") for a in batch]

    async def scenario():
        opened, sent = asyncio.Event(), []
        w = worker_with(generate_batch, opened, sent, features)
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            w._start(executor, [assignment("t0")])
            stream = asyncio.create_task(w._one_stream(executor))
            await asyncio.sleep(0.05)  # the hello is out, the stream not up yet
            go.set()
            while w._running:
                await asyncio.sleep(0.01)
            opened.set()
            await asyncio.sleep(0.05)
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
        return sent

    sent = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert named(sent[0].hello) == [(1, ["t0"])]
    if features == "renew":
        assert [r.WhichOneof("kind") for r in sent] == ["hello"]
        return
    assert [r.WhichOneof("kind") for r in sent] == ["hello", "release"] and list(sent[1].release.task_ids) == ["t0"]
    assert sent[1].release.failed


def test_a_release_of_a_task_the_next_hello_does_not_name_is_not_sent_on_it():
    # Given back while no stream was up, before the hello was built: the coordinator queues it
    # again on its own; sent after the hello, it could free a copy handed out anew on that stream.
    async def scenario():
        opened, sent = asyncio.Event(), []
        opened.set()
        w = worker_with(lambda batch: [], opened, sent)
        w._send(spb.WorkRequest(release=spb.ReleaseTasks(iteration=1, task_ids=["gone"], reason="engine error")))
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            stream = asyncio.create_task(w._one_stream(executor))
            await asyncio.sleep(0.05)
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
        return sent

    sent = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert [r.WhichOneof("kind") for r in sent] == ["hello"] and named(sent[0].hello) == []


def test_a_draining_worker_does_not_name_the_tasks_it_gave_back():
    # _drain releases and cancels what runs; a stream reopened before the engine returned named
    # them again, and the coordinator held them for a worker that would neither finish nor release them.
    go = threading.Event()

    def generate_batch(batch):
        go.wait(5)
        return [TaskFailure(a.task.task_id, "late") for a in batch]

    async def scenario():
        opened, sent = asyncio.Event(), []
        opened.set()
        w = worker_with(generate_batch, opened, sent)
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            first = asyncio.create_task(w._one_stream(executor))
            await asyncio.sleep(0.05)
            w._start(executor, [assignment("t0")])
            never = asyncio.create_task(asyncio.sleep(10))
            await w._drain(never, timeout_s=0.05)
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            sent.clear()
            second = asyncio.create_task(w._one_stream(executor))  # the stream broke during the drain
            await asyncio.sleep(0.05)
            second.cancel()
            await asyncio.gather(second, return_exceptions=True)
            go.set()
            never.cancel()
        return sent

    sent = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert named(sent[0].hello) == []
