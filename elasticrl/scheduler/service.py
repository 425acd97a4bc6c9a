"""gRPC servicer of ``elasticrl.v1.Scheduler``: validates and converts messages, calls ``core``.

Errors map exactly as in the coordinator's servicer (``coordinator.service.guarded``). The Work
stream has one reader task (hello, results, releases, lease renewals) and one writer (this
generator draining the worker's outbox), like the coordinator's Session stream. PublishWeights and FetchWeights move a
run's policy weights in and out of the ``WeightStore`` (``weights.py``) in chunks.
"""

from __future__ import annotations

import asyncio
import logging
import math

import grpc
from google.protobuf.message import DecodeError

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl._proto import scheduler_pb2_grpc as spb_grpc
from elasticrl.coordinator import validate as v
from elasticrl.coordinator.replies import request_id
from elasticrl.coordinator.service import abort_with, add_service, guarded, optional_member
from elasticrl.coordinator.wire import MAX_MESSAGE_BYTES
from elasticrl.errors import CoordinatorTimeoutError, ElasticRLError, InternalError, InvalidRequestError
from elasticrl.scheduler import framing, outbox
from elasticrl.scheduler.core import End, SchedulerCore, WorkerConn
from elasticrl.scheduler.results import ResultPipeline
from elasticrl.scheduler.convert import (
    POLICY_FROM_PB,
    SPLIT_FROM_PB,
    group_from_pb,
    manifest_to_pb,
    served_fields_pb,
    task_from_pb,
)
from elasticrl.scheduler.state import WORK_FEATURES, IterationConfig
from elasticrl.scheduler.weights import CHUNK_BYTES, WeightStore
from elasticrl.weights import directory

log = logging.getLogger(__name__)

MAX_TASKS = 100_000
# A submit of at least this many tasks converts them in a thread (see SubmitIteration).
THREADED_SUBMIT_TASKS = 1000
MAX_SLOTS = 4096
DEFAULT_FETCH_MESSAGE_BYTES = 4 << 20
HELLO_TIMEOUT_S = 30.0
MAX_ENV_ERRORS = 1 << 20  # per release message: a metric, clamped so a bad client cannot skew it wildly
MAX_TASK_FAILURES = 100
MAX_WEIGHTS_WAIT_S = 60.0
# Chunks this large are written and hashed in a worker thread, off the event loop.
THREADED_CHUNK_BYTES = 1 << 20
# An upload whose next chunk does not come within this long is dropped (its slot and temp file freed).
UPLOAD_IDLE_S = 120.0

def _weights_wait(have_version: int, wait_s: float) -> float:
    """The checked ``have_version`` and ``wait_s`` of FetchWeights and LocateWeights: the wait."""
    if have_version < -1:
        raise InvalidRequestError(f"have_version: {have_version} must be >= -1 (-1: no weights held yet)")
    if not math.isfinite(wait_s) or not 0 <= wait_s <= MAX_WEIGHTS_WAIT_S:
        raise InvalidRequestError(f"wait_s: {wait_s!r} must be in 0..{MAX_WEIGHTS_WAIT_S:g} seconds (repeat the call to wait longer)")
    return wait_s


class SchedulerServicer(spb_grpc.SchedulerServicer):
    def __init__(self, core: SchedulerCore, *, weights: WeightStore | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.core = core
        self.results = ResultPipeline(core)
        self.weights = weights if weights is not None else WeightStore(None)
        self.upload_idle_s = UPLOAD_IDLE_S
        # What FetchWeights sends per message: 4 MiB, or less under a small --max-message-mb.
        self.weight_chunk_bytes = min(CHUNK_BYTES, max_message_bytes // 2)
        self.directory = directory.WeightDirectory()

    @guarded
    async def SubmitIteration(self, request: spb.SubmitIterationRequest, context) -> spb.SubmitIterationResponse:
        run_id = v.ident("run_id", request.run_id)
        if not request.tasks:
            raise InvalidRequestError("tasks: must not be empty")
        if len(request.tasks) > MAX_TASKS:
            raise InvalidRequestError(f"tasks: {len(request.tasks)} tasks, at most {MAX_TASKS} per iteration")
        if len(request.tasks) >= THREADED_SUBMIT_TASKS:
            # ~7 us of Python per task: in a thread, the event loop (every stream, barrier and
            # keep-alive) gets the GIL back at each switch interval instead of after all of them.
            specs = await asyncio.to_thread(_task_specs, request.tasks)
        else:
            specs = _task_specs(request.tasks)
        seen = set()
        for i, s in enumerate(specs):
            if s.task_id in seen:
                raise InvalidRequestError(f"tasks[{i}].task_id: {s.task_id!r} appears twice; task ids must be unique")
            seen.add(s.task_id)
        if request.policy not in POLICY_FROM_PB:
            raise InvalidRequestError(f"policy: {request.policy} is not a known SchedulePolicy value")
        frac = request.min_fraction or 1.0
        if not math.isfinite(frac) or not 0 < frac <= 1:
            raise InvalidRequestError(f"min_fraction: {request.min_fraction!r} must be in (0, 1] (0 means 1)")
        config = IterationConfig(
            policy=POLICY_FROM_PB[request.policy],
            deadline_s=v.duration_ms("deadline_ms", request.deadline_ms),
            min_fraction=frac,
            task_lease_s=v.duration_ms("task_lease_ms", request.task_lease_ms) or 600.0,
            backup_tasks=request.backup_tasks,
            max_task_failures=request.max_task_failures or 2,
        )
        if config.max_task_failures > MAX_TASK_FAILURES:
            raise InvalidRequestError(f"max_task_failures: {request.max_task_failures} must be in 1..{MAX_TASK_FAILURES} (0 means 2)")
        writer = optional_member("member", request)
        if writer is not None:  # a fenced driver cannot queue work
            self.core.coord.check_member(run_id, *writer)
        created = self.core.submit(
            run_id, request.iteration, specs, config, request_id=request_id("request_id", request.request_id)
        )
        return spb.SubmitIterationResponse(created=created, num_tasks=len(specs))

    @guarded
    async def WaitSealed(self, request: spb.WaitSealedRequest, context) -> spb.WaitSealedResponse:
        run_id = v.ident("run_id", request.run_id)
        wait_s = v.duration_ms("wait_ms", request.wait_ms, high=60_000)
        it = await self.core.wait_sealed(run_id, request.iteration, wait_s)
        if it is None:  # not submitted yet: an empty, open manifest
            return spb.WaitSealedResponse(manifest=spb.IterationManifest(run_id=run_id, iteration=request.iteration))
        # Still open: the counts only (the caller polls again); the whole manifest once sealed.
        return spb.WaitSealedResponse(manifest=manifest_to_pb(self.core.manifest(it, per_node=it.sealed)))

    @guarded
    async def IterationStatus(self, request: spb.IterationStatusRequest, context) -> spb.IterationStatusResponse:
        run_id = v.ident("run_id", request.run_id)
        if request.latest:
            it = self.core.latest(run_id)
        else:
            it = self.core.iterations.get(run_id, {}).get(request.iteration)
        if it is None:
            return spb.IterationStatusResponse(found=False)
        return spb.IterationStatusResponse(found=True, manifest=manifest_to_pb(self.core.manifest(it)))

    async def FetchShard(self, request: spb.FetchShardRequest, context):
        try:
            run_id = v.ident("run_id", request.run_id)
            if request.world_size < 1:
                raise InvalidRequestError(f"world_size: {request.world_size} must be >= 1")
            if request.split not in SPLIT_FROM_PB:
                raise InvalidRequestError(f"split: {request.split} is not a known Split value")
            limit = request.max_message_bytes or DEFAULT_FETCH_MESSAGE_BYTES
            groups = self.core.shard(run_id, request.iteration, request.rank, request.world_size, SPLIT_FROM_PB[request.split])
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await abort_with(context, exc)
            return
        # Each group as stored (a received group: the bytes its worker sent) plus the fields the
        # coordinator fills, appended (protobuf merges them): FetchShardResponse bytes, no messages.
        total_tokens = sum(g.num_tokens for g, _ in groups)
        batch, size, first = [], 0, True
        for group, task in groups:
            parts, n = framing.group_parts(request.iteration, group)
            served = served_fields_pb(group.node, task.spec)
            batch.append(([*parts, served], n + len(served)))
            size += n + len(served)
            if size >= limit:
                yield framing.fetch_response(batch, len(groups) if first else 0, total_tokens if first else 0)
                batch, size, first = [], 0, False
        if batch or first:
            yield framing.fetch_response(batch, len(groups) if first else 0, total_tokens if first else 0)

    @guarded
    async def PublishWeights(self, chunks, context) -> spb.PublishWeightsReply:
        """One blob as a stream of chunks: see PublishWeights in scheduler.proto. The chunks go to
        the upload's temp file; whatever ends the stream (an error, a cancel, the client going
        away), ``close`` deletes that file unless the blob was committed."""
        upload, i = None, 0
        try:
            async for c in _idle_limited(chunks, self.upload_idle_s):
                if upload is None:  # a stale version or an oversized blob is refused before any transfer
                    upload = self.weights.begin(
                        run_id=c.run_id, version=c.version, total_bytes=c.total_bytes, sha256=c.sha256, format=c.format
                    )
                else:
                    upload.check_header(i, run_id=c.run_id, version=c.version, total_bytes=c.total_bytes, sha256=c.sha256, format=c.format)
                if len(c.data) >= THREADED_CHUNK_BYTES:
                    await asyncio.to_thread(upload.add, i, c.offset, c.data)
                else:
                    upload.add(i, c.offset, c.data)
                i += 1
            if upload is None:
                raise InvalidRequestError("chunks: the stream ended before its first WeightChunk; send at least one")
            blob = await asyncio.to_thread(upload.finish)
            created = await self.weights.commit(blob)
        finally:
            if upload is not None:
                upload.close()
        return spb.PublishWeightsReply(version=blob.version, total_bytes=blob.total_bytes, sha256=blob.sha256, created=created)

    async def FetchWeights(self, request: spb.FetchWeightsRequest, context):
        try:
            run_id = v.ident("run_id", request.run_id)
            wait_s = _weights_wait(request.have_version, request.wait_s)
            blob = await self.weights.wait_newer(run_id, request.have_version, wait_s)
            # In the same event-loop step as wait_newer's answer: a newer publish may delete the
            # file afterwards, but not while it is open here (see WeightBlob.open).
            f = None if blob is None else blob.open()
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await abort_with(context, exc)
            return
        if blob is None:  # nothing newer within wait_s: an empty stream
            return
        step = self.weight_chunk_bytes
        with f:
            for offset in range(0, blob.total_bytes, step):
                data = await asyncio.to_thread(f.read, step)
                yield spb.WeightChunk(
                    run_id=blob.run_id, version=blob.version, total_bytes=blob.total_bytes, offset=offset,
                    data=data, sha256=blob.sha256, format=blob.format,
                )

    @guarded
    async def AnnounceWeights(self, request: spb.AnnounceWeightsRequest, context) -> spb.AnnounceWeightsReply:
        """Metadata only: see AnnounceWeights in scheduler.proto."""
        run_id = v.ident("run_id", request.run_id)
        version = directory.Version.checked(request.version, request.total_bytes, request.sha256, request.format)
        member = v.ident("member_id", request.member_id)
        addr = directory.address("address", request.address)
        newest = self.directory.announce(run_id, version, member, addr, request.complete)
        return spb.AnnounceWeightsReply(newest_version=newest)

    @guarded
    async def LocateWeights(self, request: spb.LocateWeightsRequest, context) -> spb.LocateWeightsReply:
        """Whom to fetch the run's newest weights from: see LocateWeights in scheduler.proto."""
        run_id = v.ident("run_id", request.run_id)
        member = v.ident("member_id", request.member_id)
        addr = directory.address("address", request.address, allow_empty=True)
        wait_s = _weights_wait(request.have_version, request.wait_s)
        unreachable = [directory.address("unreachable", a) for a in v.batch("unreachable", list(request.unreachable), allow_empty=True)]
        src = await self.directory.locate(run_id, member, addr, request.have_version, wait_s, unreachable)
        if src is None:
            return spb.LocateWeightsReply(found=False)
        ver = src.version
        return spb.LocateWeightsReply(
            found=True, version=ver.version, total_bytes=ver.total_bytes, sha256=ver.sha256, format=ver.format,
            address=src.address, source_member=src.member_id, source_complete=src.complete,
        )

    async def Work(self, requests, context):
        """One engine's stream: see the Work RPC in scheduler.proto. Its requests come as bytes
        (``add_to_server``): result batches are read in place (``framing``), the rest parsed."""
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                first = await _first(requests)
            conn = self._connect(_parsed(first))
        except TimeoutError:
            await abort_with(context, InvalidRequestError(f"hello: none received within {HELLO_TIMEOUT_S:g}s"))
            return
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await abort_with(context, exc)
            return
        await context.send_initial_metadata((WORK_FEATURES,))
        reader = asyncio.create_task(self._read(conn, requests), name=f"work-read-{conn.worker.member_id}")
        reason = "stream ended"
        writer = outbox.Writer(conn)
        try:
            while True:
                item = await writer.next()
                if isinstance(item, End):
                    if item.error is None:
                        return
                    reason = str(item.error)
                    if isinstance(item.error, grpc.aio.AbortError):
                        raise item.error
                    await abort_with(context, item.error)
                yield item
        finally:
            reader.cancel()
            # Abrupt unless the coordinator ended it (a closed run): a killed worker's reset often
            # reads as a half-close here. A worker that stops on purpose leaves first, and the end
            # of a departed member's stream evicts nobody.
            self.core.disconnect(conn, reason, abrupt=not conn.run_closed)

    def _connect(self, request: spb.WorkRequest) -> WorkerConn:
        if request.WhichOneof("kind") != "hello":
            raise InvalidRequestError("hello: the first message of a Work stream must be a hello")
        h = request.hello
        run_id = v.ident("hello.run_id", h.run_id)
        member_id = v.ident("hello.member.member_id", h.member.member_id)
        incarnation = v.incarnation("hello.member.incarnation", h.member.incarnation)
        if not 1 <= h.slots <= MAX_SLOTS:
            raise InvalidRequestError(f"hello.slots: {h.slots} must be in 1..{MAX_SLOTS} (tasks the engine runs at once)")
        weight = v.weight("hello.weight", h.weight)
        if (n := sum(len(keys.task_ids) for keys in h.running)) > MAX_SLOTS:
            raise InvalidRequestError(f"hello.running: {n} tasks; at most {MAX_SLOTS} (those the engine still runs)")
        running = [(keys.iteration, task_id) for keys in h.running for task_id in keys.task_ids] if h.reports_running else None
        conn = self.core.connect(run_id, member_id, incarnation, slots=h.slots, weight=weight, running=running)
        conn.combined_acks = h.combined_acks
        return conn

    async def _read(self, conn: WorkerConn, requests) -> None:
        try:
            async for raw in _read_ahead(requests):
                batch = _result_batch(conn, raw)
                if batch is None:
                    # Not results, or results in a form framing leaves to protobuf (an unknown
                    # field beside them, a long key, a batch in pieces): the parsed message.
                    request = _parsed(raw)
                    batch = _result_batch(conn, request)
                if batch is not None:  # acked once committed (an error instead ends the stream)
                    groups, invalid, batch_id = batch
                    await self.results.submit(conn, groups, request_id("results.batch_id", batch_id), invalid)
                    continue
                kind = request.WhichOneof("kind")
                if kind == "release":
                    r = request.release
                    self.core.release(
                        conn, r.iteration, list(r.task_ids), v.text("release.reason", r.reason, v.MAX_REASON_LEN),
                        failed=r.failed, env_errors=min(r.env_errors, MAX_ENV_ERRORS),
                    )
                elif kind == "renew":
                    r = request.renew
                    self.core.renew(conn, r.iteration, list(r.task_ids))
                else:
                    raise InvalidRequestError(f"kind: {kind or 'nothing'} is not allowed after the hello (send results, release or renew)")
            conn.send(End())
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError as exc:
            conn.send(End(exc))
        except Exception as exc:  # noqa: BLE001 - ends the stream with its status
            # The core's own errors keep their status: CoordinatorUnavailableError (batches not
            # stored in time) is one the worker reconnects after; as INTERNAL it stopped for good.
            if not isinstance(exc, ElasticRLError):
                log.exception("work stream of %s failed", conn.worker.member_id)
                exc = InternalError(f"internal error: {type(exc).__name__}: {exc}")
            elif not isinstance(exc, InvalidRequestError):
                log.warning("work stream of %s ends: %s", conn.worker.member_id, exc)
            conn.send(End(exc))


async def _read_ahead(requests):
    """``requests``, the next message already asked for while the caller acts on this one.

    With no read pending, a worker's next 1 MiB result batch waited in gRPC's transport while the
    coordinator acted on the previous one: in ``bench/scheduler.py``'s stream a batch took
    2.0 ms (median) from the worker's send to the coordinator's read, 1.3 ms with this, the
    largest share of a batch's round trip either way. Memory stays bounded: one message ahead."""
    it = requests.__aiter__()
    ahead = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            try:
                item = await ahead
            except StopAsyncIteration:
                return
            ahead = asyncio.ensure_future(it.__anext__())
            yield item
    finally:
        ahead.cancel()


async def _idle_limited(chunks, idle_s: float):
    """``chunks``, failing the upload when the next one takes longer than ``idle_s``: a client
    that stalls must not hold an upload slot and its temp file until its own deadline (if any)."""
    it = chunks.__aiter__()
    while True:
        try:
            async with asyncio.timeout(idle_s):
                chunk = await it.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise CoordinatorTimeoutError(
                f"chunks: none received for {idle_s:g}s; the upload was dropped, publish again"
            ) from None
        yield chunk


async def _first(requests):
    async for request in requests:
        return request
    raise InvalidRequestError("hello: the stream closed before its hello")


def _task_specs(tasks) -> list:
    """A submit's tasks, checked and converted (their messages kept: ``convert.task_wire``)."""
    return [task_from_pb(f"tasks[{i}]", t, keep_wire=True) for i, t in enumerate(tasks)]


def _parsed(raw: bytes | spb.WorkRequest) -> spb.WorkRequest:
    if not isinstance(raw, bytes):
        return raw
    try:
        return spb.WorkRequest.FromString(raw)
    except DecodeError as exc:
        raise InvalidRequestError(f"request is not a valid {spb.WorkRequest.DESCRIPTOR.full_name}: {exc}") from None


def _result_batch(conn: WorkerConn, raw: bytes | spb.WorkRequest):
    """A result batch's (groups, refused as invalid, batch id), or None for any other request.
    Groups are read where they lie in the received bytes (``framing.WireGroup``); a message that
    arrived parsed (another registration, a test) is converted as before."""
    groups, invalid = [], []
    if isinstance(raw, bytes):
        try:
            found = framing.result_batch_spans(raw)
            if found is None:
                return None
            batch_id, spans = found
            for i, (start, end) in enumerate(spans):
                try:
                    groups.append(framing.read_group(f"results.groups[{i}]", raw, start, end))
                except InvalidRequestError as exc:  # refuse that group, keep the stream
                    log.warning("worker %s sent a malformed result: %s", conn.worker.member_id, exc)
                    invalid.append((*framing.group_key(raw, start, end), f"invalid: {exc}"))
        except (framing.FramingError, DecodeError) as exc:
            raise InvalidRequestError(f"request is not a valid {spb.WorkRequest.DESCRIPTOR.full_name}: {exc}") from None
        return groups, invalid, batch_id
    if raw.WhichOneof("kind") != "results":
        return None
    for i, g in enumerate(raw.results.groups):
        try:
            groups.append(group_from_pb(f"results.groups[{i}]", g))
        except InvalidRequestError as exc:
            log.warning("worker %s sent a malformed result: %s", conn.worker.member_id, exc)
            invalid.append((g.iteration, g.task_id, f"invalid: {exc}"))
    return groups, invalid, raw.results.batch_id


def _response_bytes(response: spb.WorkResponse | bytes) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_to_server(servicer: SchedulerServicer, server: grpc.aio.Server) -> None:
    add_service(servicer, server, spb, "Scheduler")
    # Work again, as a registered method, which grpc serves before the generic handler above: its
    # requests arrive as the bytes received, so a result batch is read in place (framing.py)
    # instead of being parsed into a message and copied out of it.
    server.add_registered_method_handlers("elasticrl.v1.Scheduler", {
        "Work": grpc.stream_stream_rpc_method_handler(servicer.Work, response_serializer=_response_bytes),
    })
