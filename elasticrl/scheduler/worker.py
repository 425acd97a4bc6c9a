"""The engine side of the scheduler: a member that pulls tasks over one Work stream and streams
trajectories back.

``RolloutWorker`` joins the run as a member (its lease renewed by a keep-alive task), opens the
stream with ``slots`` credits, runs each assigned task through a blocking ``generate`` callable
in a thread pool of ``slots`` threads (or, with ``generate_batch``, the tasks of one iteration in
each assignment message in one call, as a batching engine wants them), and sends finished groups
in batches: a batch goes out when it reaches ``batch_bytes`` or ``linger_s`` after its first
group, whichever comes first.

Nothing is lost on a broken stream: every batch stays in ``unacked`` until the coordinator acks
it (after storing it durably) and is re-sent, in order, on the next stream; the coordinator
accepts each task once, so a re-sent group it already stored is refused as a duplicate. When the
coordinator says this incarnation is fenced (its lease lapsed while the process was paused, say),
``run`` raises ``FencedError``: the caller may join again as a new incarnation.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable

import grpc

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl.coordinator import codes, wire
from elasticrl.coordinator.aio_client import AsyncCoordinatorClient
from elasticrl.coordinator.aio_session import worth_reopening
from elasticrl.errors import CoordinatorUnavailableError, ElasticRLError, FencedError
from elasticrl.repeats import Repeats
from elasticrl.scheduler import framing
from elasticrl.scheduler.convert import task_from_pb
from elasticrl.scheduler.state import RELEASE_STOPPING, WORK_FEATURES, GroupRecord, TaskFailure, TaskSpec

log = logging.getLogger(__name__)


WORK_METHOD = "/elasticrl.v1.Scheduler/Work"
# A task lease is renewed at most every eighth of the lease; the renewal tick stays within these bounds.
RENEW_MIN_S = 0.05
RENEW_MAX_S = 30.0


def _request_bytes(request: spb.WorkRequest | bytes) -> bytes:
    """The Work stream's serializer: result batches are already bytes (``framing``), the rest messages."""
    return request if isinstance(request, bytes) else request.SerializeToString()


@dataclasses.dataclass
class Assignment:
    """One task handed to this worker. ``cancelled`` is set when another copy finished it or its
    iteration sealed: an engine that checks it can stop early (its result would be dropped)."""

    iteration: int
    task: TaskSpec
    lease_s: float
    backup: bool
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    progressed_at: float = 0.0
    """``time.monotonic()`` of the engine's last word of progress on it (``progress``)."""
    renewed_at: float = 0.0
    """When the worker last asked the coordinator to renew its task lease."""
    on_progress: Callable[[], None] | None = dataclasses.field(default=None, repr=False, compare=False)
    """Wakes the worker's lease renewal (set by the worker)."""

    def progress(self) -> None:
        """The engine advanced on this task (an episode's turn ended, or a decoding step of a
        ``generate`` for it, at most once a second); any thread may call it. The
        worker renews the task's lease (``RenewTasks``) within ``lease_s / 8``, so a long episode
        that keeps advancing is not handed to another engine when ``lease_s`` passes."""
        first = self.progressed_at <= self.renewed_at  # since the last renewal: one wake-up each
        self.progressed_at = time.monotonic()
        if first and self.on_progress is not None:
            self.on_progress()


def by_iteration(items: list[Assignment]) -> list[list[Assignment]]:
    """One batch per iteration, oldest first: the tasks of an iteration ask for one policy version,
    and a batch whose engine waits for a newer version (a task submitted ahead) must not hold back
    the results of an older iteration that the trainer is waiting for."""
    batches: dict[int, list[Assignment]] = {}
    for a in items:
        batches.setdefault(a.iteration, []).append(a)
    return [batches[i] for i in sorted(batches)]


Generate = Callable[[Assignment], GroupRecord]
"""Runs one task (blocking, in a worker thread) and returns its group. ``task_id`` must match;
``gen_seconds`` is measured for it when left 0."""

GenerateBatch = Callable[[list[Assignment]], list[GroupRecord | TaskFailure]]
"""Runs the tasks of one iteration in one assignment message together (an engine that batches prompts), returning
their groups in the same order; a ``TaskFailure`` in place of a group reports that task's attempt
as failed (its environment raised), which the scheduler retries elsewhere or gives up."""


@dataclasses.dataclass
class WorkerStats:
    completed: int = 0
    accepted: int = 0
    refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    cancelled: int = 0
    failed: int = 0
    batches_sent: int = 0
    bytes_sent: int = 0
    reconnects: int = 0


class RolloutWorker:
    def __init__(
        self,
        address: str,
        run_id: str,
        member_id: str,
        generate: Generate | None,
        *,
        generate_batch: GenerateBatch | None = None,
        slots: int = 1,
        weight: float = 1.0,
        token: str | None = None,
        tls_ca: str | None = None,
        lease_ttl_s: float = 0.0,
        call_timeout_s: float = 10.0,
        reconnect_timeout_s: float = 60.0,
        batch_bytes: int = 4 << 20,
        linger_s: float = 0.01,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
    ):
        if slots < 1:
            raise ValueError(f"slots: {slots} must be >= 1 (tasks the engine runs at once)")
        if not 0 < batch_bytes < max_message_bytes:
            raise ValueError(f"batch_bytes: {batch_bytes} must be in (0, max_message_bytes={max_message_bytes})")
        self.address = address
        self.run_id = run_id
        self.member_id = member_id
        if (generate is None) == (generate_batch is None):
            raise ValueError("pass exactly one of generate (one task per call) and generate_batch")
        self.generate = generate
        self.generate_batch = generate_batch
        self.slots = slots
        self.weight = weight
        self.lease_ttl_s = lease_ttl_s
        self.batch_bytes = batch_bytes
        self.linger_s = linger_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self._client_kwargs = dict(
            token=token, tls_ca=tls_ca, call_timeout_s=call_timeout_s,
            reconnect_timeout_s=reconnect_timeout_s, max_message_bytes=max_message_bytes,
        )
        self.stats = WorkerStats()
        self.incarnation = 0
        self.fenced: FencedError | None = None
        self._client: AsyncCoordinatorClient | None = None
        self._running: dict[tuple[int, str], Assignment] = {}
        self._tasks: set[asyncio.Task] = set()
        # The next result batch's groups, (iteration, group); serialized when it is sent.
        self._pending: list[tuple[int, GroupRecord]] = []
        self._pending_bytes = 0
        self._flush_timer: asyncio.TimerHandle | None = None
        # Result batches sent and not acknowledged yet, serialized WorkRequests (framing.py), oldest first,
        # and the (iteration, task id) keys each holds.
        self.unacked: collections.deque[bytes] = collections.deque()
        self._unacked_keys: collections.deque[list[tuple[int, str]]] = collections.deque()
        self._outbox: asyncio.Queue | None = None
        # Releases made while no stream was up (``_send``): those of tasks the next hello names in
        # ``running`` go on that stream after the hello, since the coordinator holds them for us again.
        self._unsent: list[spb.WorkRequest] = []
        self._stopping = False
        self._leaving = False  # a clean stop's leave is on its way: the stream's end says nothing
        self._acked = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._renew_wake: asyncio.Event | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Join, work until ``stop`` is set (then finish and flush what runs, and leave), or until
        fenced (raises ``FencedError``) or the coordinator stays unreachable past the reconnect
        budget (raises ``CoordinatorUnavailableError``)."""
        stop = stop or asyncio.Event()
        self._client = client = AsyncCoordinatorClient(self.address, **self._client_kwargs)
        executor = concurrent.futures.ThreadPoolExecutor(self.slots, thread_name_prefix=f"engine-{self.member_id}")
        try:
            joined = await client.join(self.run_id, self.member_id, weight=self.weight, lease_ttl_s=self.lease_ttl_s)
            self.incarnation = joined.incarnation
            log.info("worker %s joined run %s as incarnation %d (%d slot(s))", self.member_id, self.run_id, self.incarnation, self.slots)
            streams = asyncio.create_task(self._serve_streams(executor), name=f"work-{self.member_id}")
            lease = asyncio.create_task(self._keep_alive(joined.lease_ttl_s), name=f"lease-{self.member_id}")
            stopper = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait({streams, lease, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if stopper in done:
                await self._drain(streams)
            elif lease in done and self.fenced is not None and not streams.done():
                await self._finish_fenced(streams)
            failed = next((t.exception() for t in (streams, lease) if t in done and t.exception() is not None), None)
            if failed is None and self.fenced is None:
                # Leave while the stream is still open: the coordinator takes a Work stream's end
                # for a crash (a half-close and a killed process's reset look alike to it), but
                # not once the member has left. Keep-alives stop first: one answered after the
                # leave reads as fenced ("left"), and a clean stop raised it.
                # The same for the stream: the coordinator ends it as fenced ("left") once the
                # leave is in, which may reach it before the leave's own answer reaches us.
                lease.cancel()
                await asyncio.gather(lease, return_exceptions=True)
                self._leaving = True
                try:
                    await client.leave(self.run_id, self.member_id, self.incarnation, "worker stopped")
                except ElasticRLError as exc:
                    log.warning("worker %s: leave failed: %s", self.member_id, exc)
                streams.cancel()
                await asyncio.gather(streams, return_exceptions=True)
            for task in (streams, lease, stopper):
                task.cancel()
            if failed is not None:
                raise failed
            if self.fenced is not None:
                raise self.fenced
        finally:
            for a in self._running.values():
                a.cancelled.set()
            for task in list(self._tasks):
                task.cancel()
            executor.shutdown(wait=False, cancel_futures=True)
            await client.close()

    async def _drain(self, streams: asyncio.Task, timeout_s: float = 30.0) -> None:
        """Stop taking work: give back what has not finished, flush results, wait for their acks."""
        self._stopping = True
        give_back = collections.defaultdict(list)
        for (iteration, task_id), a in self._running.items():
            a.cancelled.set()
            give_back[iteration].append(task_id)
        self._running.clear()  # given back: a hello of a stream reopened meanwhile must not name them
        for iteration, task_ids in give_back.items():
            self._send(spb.WorkRequest(release=spb.ReleaseTasks(iteration=iteration, task_ids=task_ids, reason=RELEASE_STOPPING)))
        self._flush()
        deadline = time.monotonic() + timeout_s
        while self.unacked and not streams.done() and time.monotonic() < deadline:
            self._acked.clear()
            try:
                async with asyncio.timeout(max(0.01, deadline - time.monotonic())):
                    await self._acked.wait()
            except TimeoutError:
                break
        if self.unacked:
            log.warning("worker %s: stopping with %d unacknowledged batch(es)", self.member_id, len(self.unacked))

    async def _finish_fenced(self, streams: asyncio.Task, timeout_s: float = 30.0) -> None:
        """Fenced while tasks still run (woken from a pause, say): let them finish and send their
        results anyway. The coordinator refuses and counts them, then ends the stream, so the
        run's manifest shows what this incarnation did late instead of it vanishing."""
        deadline = time.monotonic() + timeout_s
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=max(0.0, deadline - time.monotonic()))
        self._flush()
        if self.unacked:
            await asyncio.wait({streams}, timeout=max(0.0, deadline - time.monotonic()))

    async def _keep_alive(self, ttl_s: float) -> None:
        outage = Repeats(10.0)  # a coordinator down: a warning every 10 s, not one per keep-alive
        while True:
            await asyncio.sleep(ttl_s / 3)
            try:
                await self._client.keep_alive(self.run_id, self.member_id, self.incarnation, retry_s=ttl_s / 3)
                outage.ok()
            except FencedError as exc:
                # Stop taking work, but keep the stream: what finishes is still sent, and the
                # coordinator refuses and counts it, then ends the stream (-> run raises).
                self.fenced = exc
                self._stopping = True
                log.error("worker %s incarnation %d fenced: %s", self.member_id, self.incarnation, exc)
                return
            except ElasticRLError as exc:
                note = outage.take()
                log.log(logging.DEBUG if note is None else logging.WARNING, "worker %s: keep-alive failed (%s); retrying%s",
                        self.member_id, exc, "" if note is None else note.outage())

    # -- streams -----------------------------------------------------------------------------

    async def _serve_streams(self, executor) -> None:
        budget = wire.ReopenBudget(self.reconnect_timeout_s)
        while True:
            was_up, detail = await self._one_stream(executor)
            pause = budget.pause_after(was_up)
            if pause is None:
                raise CoordinatorUnavailableError(
                    f"coordinator at {self.address} is unreachable: work stream not reopened within "
                    f"{self.reconnect_timeout_s:.1f}s ({detail})"
                )
            self.stats.reconnects += 1
            log.info("worker %s: work stream broke (%s); reopening in %.2fs", self.member_id, detail, pause)
            await asyncio.sleep(pause)

    async def _one_stream(self, executor) -> tuple[bool, str]:
        """Hello, re-send unacked batches, then act on assignments, cancels and acks until the
        stream ends. Returns (whether it was up, why it ended) if a new stream may help; raises
        the mapped error (``FencedError``...) if not."""
        outbox: asyncio.Queue = asyncio.Queue()
        hello = spb.WorkerHello(run_id=self.run_id, slots=self.slots, weight=self.weight, combined_acks=True,
                                reports_running=True)
        hello.member.member_id, hello.member.incarnation = self.member_id, self.incarnation
        for iteration, keys in itertools.groupby(sorted(self._running), key=lambda key: key[0]):
            # Still running from the stream before: held for this worker again, not handed out anew.
            hello.running.add(iteration=iteration, task_ids=[task_id for _, task_id in keys])
        self._unsent = []  # of tasks this hello does not name: queued again by the coordinator
        outbox.put_nowait(spb.WorkRequest(hello=hello))
        work = self._client._channel.stream_stream(
            WORK_METHOD, request_serializer=_request_bytes, response_deserializer=spb.WorkResponse.FromString,
        )
        call = work(wire.stream_requests(outbox), metadata=self._client._metadata)
        up, renewer = False, None
        try:
            try:
                async with asyncio.timeout(self._client.call_timeout_s):
                    await call.initial_metadata()
            except TimeoutError:
                call.cancel()
                return False, f"stream not opened within {self._client.call_timeout_s:.1f}s"
            if not call.done():
                up = True
                self._outbox = outbox
                for request in self.unacked:  # the coordinator may not have stored them
                    outbox.put_nowait(request)
                features = set(dict(await call.initial_metadata() or ()).get(WORK_FEATURES[0], "").split(","))
                if "running" in features:  # it holds what the hello named: these free those slots
                    for request in self._unsent:  # given back while this stream opened
                        outbox.put_nowait(request)
                self._unsent = []
                if "renew" in features:  # an older coordinator ends the stream on a renewal
                    renewer = asyncio.create_task(self._renew_leases(), name=f"renew-{self.member_id}")
            async for resp in call:
                for ack in resp.acks:  # sent with an assignment (or several together), oldest first
                    self._ack(ack)
                kind = resp.WhichOneof("kind")
                if kind == "assign":
                    self._start(executor, list(resp.assign.tasks))
                elif kind == "cancel":
                    for task_id in resp.cancel.task_ids:
                        a = self._running.pop((resp.cancel.iteration, task_id), None)
                        if a is not None:
                            a.cancelled.set()
                            self.stats.cancelled += 1
                elif kind == "ack":
                    self._ack(resp.ack)
            return up, "the coordinator ended the stream"
        except grpc.RpcError as err:
            if worth_reopening(err):
                return up, err.details() or err.code().name
            exc = codes.error_from_rpc(err, self.address)
            if isinstance(exc, FencedError) and not self._leaving:
                self.fenced = exc
            raise exc from None
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            if renewer is not None:
                renewer.cancel()
            self._outbox = None
            outbox.put_nowait(None)

    def _progressed(self) -> None:
        """``Assignment.on_progress``, from an engine thread: wake the lease renewal."""
        loop, wake = self._loop, self._renew_wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed (the worker stopped): no renewal needed; never the episode's failure
                pass

    async def _renew_leases(self) -> None:
        """Ask the coordinator to renew the leases of the tasks whose engine made progress since
        their last renewal (``Assignment.progress``), each at most every eighth of its lease: at
        once when woken by a task's first progress since its renewal, else at the next tick (an
        eighth of the shortest lease running, ``RENEW_MIN_S`` .. ``RENEW_MAX_S``). Best effort,
        like a release: a renewal that does not arrive leaves the lease to run out."""
        self._loop, self._renew_wake = asyncio.get_running_loop(), asyncio.Event()
        while True:
            every = min((a.lease_s for a in self._running.values()), default=RENEW_MAX_S * 8) / 8
            try:
                async with asyncio.timeout(min(max(every, RENEW_MIN_S), RENEW_MAX_S)):
                    await self._renew_wake.wait()
            except TimeoutError:
                pass
            self._renew_wake.clear()
            now, due = time.monotonic(), {}
            for a in self._running.values():
                if a.progressed_at > a.renewed_at and now - a.renewed_at >= a.lease_s / 8:
                    due.setdefault(a.iteration, []).append(a.task.task_id)
                    a.renewed_at = now
            for iteration, task_ids in sorted(due.items()):
                self._send(spb.WorkRequest(renew=spb.RenewTasks(iteration=iteration, task_ids=task_ids)))

    def _ack(self, ack: spb.ResultAck) -> None:
        """The oldest unacknowledged batch is stored (acks come in batch order)."""
        if self.unacked:
            self.unacked.popleft()
            self._unacked_keys.popleft()
        self.stats.accepted += ack.accepted
        for r in ack.refused:
            self.stats.refused[r.reason.split(":")[0]] += 1
        self._acked.set()

    # -- tasks and results ---------------------------------------------------------------------

    def _has(self, key: tuple[int, str]) -> bool:
        """This worker runs ``key``, or holds its result (not sent yet, or not acknowledged)."""
        return (key in self._running or any(key == (i, g.task_id) for i, g in self._pending)
                or any(key in keys for keys in self._unacked_keys))

    def _start(self, executor, messages: list[spb.TaskAssignment]) -> None:
        items = []
        for a in messages:
            spec = task_from_pb("assign.task", a.task)
            if self._stopping:
                self._send(spb.WorkRequest(release=spb.ReleaseTasks(iteration=a.iteration, task_ids=[spec.task_id], reason=RELEASE_STOPPING)))
                continue
            if self._has((a.iteration, spec.task_id)):
                # Handed out again on a new stream: the coordinator dispatched it on the hello,
                # before it read the re-sent batch with its result, or (an older coordinator, which
                # does not read the hello's running) while this copy still runs. The copy here
                # answers it; a second run went past the slots and was refused.
                continue
            assignment = Assignment(a.iteration, spec, a.lease_ms / 1000, a.backup, on_progress=self._progressed)
            self._running[(a.iteration, spec.task_id)] = assignment
            items.append(assignment)
        batches = by_iteration(items) if self.generate_batch is not None else [[a] for a in items]
        for batch in batches:
            if batch:
                task = asyncio.create_task(self._run_tasks(executor, batch))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _run_tasks(self, executor, batch: list[Assignment]) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            if self.generate_batch is not None:
                groups = await loop.run_in_executor(executor, self.generate_batch, batch)
                if len(groups) != len(batch):
                    raise AssertionError(f"generate_batch returned {len(groups)} groups for {len(batch)} tasks")
            else:
                groups = [await loop.run_in_executor(executor, self.generate, batch[0])]
        except Exception as exc:  # noqa: BLE001 - an engine failure gives the tasks back, it does not kill the worker
            if getattr(exc, "stopping", False):  # the engine is stopping (a world re-forming): not a failure
                log.info("worker %s: %d task(s) given back: %s", self.member_id, len(batch), exc)
            else:
                log.exception("worker %s: %d task(s) failed", self.member_id, len(batch))
                self.stats.failed += len(batch)
            for a in batch:
                if self._untrack(a):
                    self._send(spb.WorkRequest(release=spb.ReleaseTasks(
                        iteration=a.iteration, task_ids=[a.task.task_id], reason=f"engine error: {type(exc).__name__}: {exc}"[:1000],
                    )))
            return
        elapsed = (time.perf_counter() - started) / len(batch)
        for a, group in zip(batch, groups):
            if not self._untrack(a) or a.cancelled.is_set():
                continue  # cancelled meanwhile: another copy won, or the iteration sealed
            if group.task_id != a.task.task_id:
                raise AssertionError(f"generate returned task {group.task_id!r} for {a.task.task_id!r}")
            if isinstance(group, TaskFailure):
                # Its environment failed: the scheduler counts the failure and retries it elsewhere.
                self.stats.failed += 1
                self._send(spb.WorkRequest(release=spb.ReleaseTasks(
                    iteration=a.iteration, task_ids=[a.task.task_id], reason=group.reason[:1000], failed=True,
                    env_errors=group.env_errors,
                )))
                continue
            if not group.gen_seconds:
                group.gen_seconds = elapsed
            self.stats.completed += 1
            self._pending.append((a.iteration, group))
            self._pending_bytes += group.num_bytes
            if self._pending_bytes >= self.batch_bytes:  # a full batch goes now, not after the rest of this one's
                self._flush()
        # Linger only while another running task may still join the batch: with every task done,
        # waiting just delays the result and, since a slot frees only when the coordinator has the
        # result, the next assignment too.
        if not self._running:
            self._flush()
        elif self._pending and self._flush_timer is None:
            self._flush_timer = loop.call_later(self.linger_s, self._flush)

    def _untrack(self, a: Assignment) -> bool:
        """``a`` is over: no longer among the tasks this worker runs. False if it was not (it was
        cancelled; the same task handed out again since is another ``Assignment``, and stays)."""
        key = (a.iteration, a.task.task_id)
        if self._running.get(key) is not a:
            return False
        del self._running[key]
        return True

    def _flush(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if not self._pending:
            return
        # The batch id stays with the batch when it is re-sent on a new stream: a batch the coordinator
        # stored before the old stream broke gets its first ack back instead of counting as duplicates.
        # Serialized by hand, the sample bytes copied once (see framing.py for what upb cost here).
        request = framing.result_batch_request(self._pending, uuid.uuid4().hex)
        self.stats.batches_sent += 1
        self.stats.bytes_sent += self._pending_bytes
        self.unacked.append(request)
        self._unacked_keys.append([(iteration, group.task_id) for iteration, group in self._pending])
        self._pending, self._pending_bytes = [], 0
        if self._outbox is not None:
            self._outbox.put_nowait(request)

    def _send(self, request: spb.WorkRequest) -> None:
        """A release or a renewal. With no stream up a renewal is dropped, and a release waits for
        the next stream: sent there if its hello names the tasks (the coordinator holds them for
        this worker again), else dropped (the coordinator queues them again on its own)."""
        if self._outbox is not None:
            self._outbox.put_nowait(request)
        elif request.WhichOneof("kind") == "release":
            self._unsent.append(request)
