"""gRPC servicer: validates and converts messages, calls ``core``, maps errors. No decisions here.

Every handler is wrapped so that an ``ElasticRLError`` becomes its status code (``codes``) and any
other exception becomes INTERNAL with its description, logged with a traceback: a bad request can
fail its own call but never the server. On a Session stream the same mapping turns a failed
operation into an ``Error`` message instead, and the stream stays open.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
from google.protobuf.message import DecodeError

from elasticrl import __version__
from elasticrl._proto import coordinator_pb2 as pb
from elasticrl._proto import coordinator_pb2_grpc as pb_grpc
from elasticrl.coordinator import codes, session, validate as v, wire
from elasticrl.coordinator.core import CoordinatorCore, Event
from elasticrl.coordinator.replies import request_id
from elasticrl.coordinator.state import (
    DEFAULT_REJOIN_TIMEOUT_S, Barrier, BarrierResult, Member, MemberStatus, RoundConfig, Run,
)
from elasticrl.errors import ElasticRLError, InternalError

log = logging.getLogger(__name__)

DEFAULT_LAST_CALL_S = 2.0
DEFAULT_JOIN_TIMEOUT_S = 600.0
WATCH_HEARTBEAT_S = 15.0
_MEMBER_STATE = {
    MemberStatus.LIVE: pb.MEMBER_STATE_LIVE,
    MemberStatus.LEFT: pb.MEMBER_STATE_LEFT,
    MemberStatus.EVICTED: pb.MEMBER_STATE_EVICTED,
}
_EVENT_TYPE = {
    "joined": pb.EVENT_TYPE_JOINED,
    "left": pb.EVENT_TYPE_LEFT,
    "evicted": pb.EVENT_TYPE_EVICTED,
    "round": pb.EVENT_TYPE_ROUND,
    "closed": pb.EVENT_TYPE_CLOSED,
}
_ROUND_STATUS = {
    "complete": pb.ROUND_STATUS_COMPLETE,
    "waiting": pb.ROUND_STATUS_WAITING,
    "timed_out": pb.ROUND_STATUS_TIMED_OUT,
    "closed": pb.ROUND_STATUS_CLOSED,
}


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, ElasticRLError):
        code, trailing = codes.status_for(exc)
        await context.abort(code, str(exc), trailing_metadata=trailing)
    log.exception("internal error in %s", type(exc).__name__, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def error_message(exc: Exception) -> pb.Error:
    """A Session operation's failure: the code and class a unary call would have failed with."""
    if isinstance(exc, ElasticRLError):
        code, trailing = codes.status_for(exc)
        return pb.Error(code=code.value[0], error_class=dict(trailing)[codes.ERROR_KEY], message=str(exc))
    log.exception("internal error in %s", type(exc).__name__, exc_info=exc)
    return pb.Error(
        code=grpc.StatusCode.INTERNAL.value[0],
        error_class=InternalError.__name__,
        message=f"internal error: {type(exc).__name__}: {exc}",
    )


def guarded(handler):
    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never escapes
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await abort_with(context, exc)

    return wrapper


def optional_member(field: str, request) -> tuple[str, int] | None:
    """The ``MemberRef`` of a request where it is optional: None when unset."""
    return v.member_ref(field, getattr(request, field)) if request.HasField(field) else None


def _write_opts(request) -> dict:
    """A KV write's idempotency key and optional writer (see the conventions in coordinator.proto)."""
    return {"request_id": request_id("request_id", request.request_id), "writer": optional_member("member", request)}


def member_info(core: CoordinatorCore, m: Member) -> pb.MemberInfo:
    return pb.MemberInfo(
        member_id=m.member_id,
        incarnation=m.incarnation,
        host=m.host,
        weight=m.weight,
        capabilities=m.capabilities,
        state=_MEMBER_STATE[m.status],
        lease_left_ms=int(core.lease_left_s(m) * 1000),
        joined_epoch=m.joined_epoch,
        reason=m.reason,
    )


def run_snapshot(core: CoordinatorCore, run: Run) -> pb.RunSnapshot:
    rdzv = run.rendezvous
    cfg = rdzv.config
    return pb.RunSnapshot(
        run_id=run.run_id,
        epoch=run.epoch,
        closed=run.closed,
        members=[member_info(core, m) for m in run.live_members().values()],
        round=pb.RoundInfo(
            round=rdzv.round,
            participants=[m for m, _ in rdzv.participants],
            waiting=list(rdzv.waiting),
            lost=[m for m, inc in rdzv.participants if not run.is_live(m, inc)],
            config=None
            if cfg is None
            else pb.RoundConfig(
                min_nodes=cfg.min_nodes,
                max_nodes=cfg.max_nodes,
                last_call_ms=int(cfg.last_call_s * 1000),
                join_timeout_ms=int(cfg.join_timeout_s * 1000),
                rejoin_timeout_ms=wire.rejoin_timeout_ms(cfg.rejoin_timeout_s),
            ),
        ),
    )


def _barrier_info(core: CoordinatorCore, run: Run, b: Barrier) -> pb.BarrierInfo:
    return pb.BarrierInfo(
        name=b.name,
        arrived=sorted(m for m, inc in b.arrived.items() if run.is_live(m, inc)),
        waiting_for=sorted(m for m, inc in b.expected.items() if run.is_live(m, inc) and b.arrived.get(m) != inc),
        age_ms=int((core.clock() - b.opened_at) * 1000),
        timeout_ms=int(b.timeout_s * 1000),
    )


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    # Decided barriers whose response is kept, so that it is built once, not once per member.
    DECIDED_RESPONSES = 64

    def __init__(self, core: CoordinatorCore, *, max_kv_value_bytes: int = v.MAX_VALUE_BYTES):
        self.core = core
        self.max_kv_value_bytes = max_kv_value_bytes
        # (run id, barrier name) -> (result, response, that response as a serialized
        # SessionResponse with no id); a decided result never changes.
        self._decided: dict[tuple[str, str], tuple[BarrierResult, pb.ArriveResponse, bytes]] = {}

    # -- membership --------------------------------------------------------------------------

    @guarded
    async def Join(self, request: pb.JoinRequest, context) -> pb.JoinResponse:
        member, epoch = self.core.join(
            v.ident("run_id", request.run_id),
            v.ident("member_id", request.member_id),
            host=v.text("host", request.host, v.MAX_HOST_LEN),
            weight=v.weight("weight", request.weight),
            capabilities=v.capabilities("capabilities", dict(request.capabilities)),
            lease_ttl_s=v.duration_ms("lease_ttl_ms", request.lease_ttl_ms, low=v.MIN_LEASE_TTL_MS, high=v.MAX_LEASE_TTL_MS),
            request_id=request_id("request_id", request.request_id),
        )
        return pb.JoinResponse(
            member=pb.MemberRef(member_id=member.member_id, incarnation=member.incarnation),
            epoch=epoch,
            lease_ttl_ms=int(member.lease_ttl_s * 1000),
        )

    @guarded
    async def KeepAlive(self, request: pb.KeepAliveRequest, context) -> pb.KeepAliveResponse:
        return self.keep_alive(request)

    def keep_alive(self, request: pb.KeepAliveRequest) -> pb.KeepAliveResponse:
        """KeepAlive for the unary RPC and Session alike. Raises ``ElasticRLError``."""
        mid, inc = v.member_ref("member", request.member)
        epoch, ttl = self.core.keep_alive(v.ident("run_id", request.run_id), mid, inc)
        return pb.KeepAliveResponse(epoch=epoch, lease_ttl_ms=int(ttl * 1000))

    @guarded
    async def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        mid, inc = v.member_ref("member", request.member)
        reason = v.text("reason", request.reason, v.MAX_REASON_LEN)
        rid = request_id("request_id", request.request_id)
        return pb.LeaveResponse(epoch=self.core.leave(v.ident("run_id", request.run_id), mid, inc, reason, request_id=rid))

    async def Watch(self, request: pb.WatchRequest, context):
        try:
            run_id = v.ident("run_id", request.run_id)
        except ElasticRLError as exc:
            await abort_with(context, exc)
        watcher = self.core.subscribe(run_id)
        try:
            run = self.core.runs.get(run_id)
            if run is not None:
                yield pb.WatchResponse(snapshot=run_snapshot(self.core, run))
            while True:
                try:
                    async with asyncio.timeout(WATCH_HEARTBEAT_S):
                        await watcher.dirty.wait()
                except TimeoutError:
                    pass  # heartbeat: a fresh snapshot proves the stream is alive
                events = watcher.take()
                run = self.core.runs.get(run_id)
                if run is None:
                    continue
                yield pb.WatchResponse(events=[self._event(e) for e in events], snapshot=run_snapshot(self.core, run))
        finally:
            self.core.unsubscribe(run_id, watcher)

    def _event(self, e: Event) -> pb.MembershipEvent:
        return pb.MembershipEvent(
            type=_EVENT_TYPE[e.kind],
            member=None if e.member is None else member_info(self.core, e.member),
            epoch=e.epoch,
            reason=e.reason,
        )

    # -- barriers ----------------------------------------------------------------------------

    @guarded
    async def Arrive(self, request: pb.ArriveRequest, context) -> pb.ArriveResponse:
        return await self.arrive(request)

    async def arrive(self, request: pb.ArriveRequest) -> pb.ArriveResponse:
        """The unary Arrive: blocks until the barrier is decided or ``wait_ms`` passes (then
        PENDING). Raises ``ElasticRLError``."""
        arrival, wait_s = session.parse_arrival(request)
        result = await self.core.arrive(
            arrival.run_id, arrival.member_id, arrival.incarnation, arrival.name,
            epoch=arrival.epoch, timeout_s=arrival.timeout_s, policy_=arrival.policy, wait_s=wait_s,
        )
        if result is None:
            return session.arrive_response(None, self.core.runs[arrival.run_id].epoch)
        return self._decided_response((arrival.run_id, arrival.name), result)[0]

    def _decided_response(self, key: tuple[str, str], result: BarrierResult) -> tuple[pb.ArriveResponse, bytes]:
        """The one response every member of a decided barrier gets (its ``arrived`` alone lists
        all N members, so building it per member made a barrier's release O(N^2)), and the same
        wrapped in a serialized SessionResponse without id, for the same reason on sessions."""
        hit = self._decided.get(key)
        if hit is not None and hit[0] is result:
            return hit[1], hit[2]
        if len(self._decided) >= self.DECIDED_RESPONSES:
            self._decided.clear()
        response = session.arrive_response(result, result.epoch)
        wrapped = pb.SessionResponse(arrive=response).SerializeToString()
        self._decided[key] = (result, response, wrapped)
        return response, wrapped

    # -- member sessions ---------------------------------------------------------------------

    def Session(self, requests, context):
        """A member's (or a process's members') stream of KeepAlive and Arrive operations: see
        ``coordinator.session`` and SessionRequest in the proto."""
        return session.serve(
            self.core, requests, context, keep_alive=self._session_keep_alive,
            decided=lambda key, result: self._decided_response(key, result)[1],
            error=lambda request_id, exc: pb.SessionResponse(id=request_id, error=error_message(exc)),
            abort=abort_with,
        )

    def _session_keep_alive(self, request_id: int, request: pb.KeepAliveRequest) -> pb.SessionResponse:
        try:
            return pb.SessionResponse(id=request_id, keep_alive=self.keep_alive(request))
        except Exception as exc:  # noqa: BLE001 - becomes this operation's Error, never the stream's
            return pb.SessionResponse(id=request_id, error=error_message(exc))

    # -- KV ----------------------------------------------------------------------------------

    @guarded
    async def KVSet(self, request: pb.KVSetRequest, context) -> pb.KVSetResponse:
        pairs = [
            (v.key(f"pairs[{i}].key", p.key), v.value(f"pairs[{i}].value", p.value, self.max_kv_value_bytes))
            for i, p in enumerate(v.batch("pairs", request.pairs))
        ]
        self.core.kv_set(v.ident("run_id", request.run_id), pairs, **_write_opts(request))
        return pb.KVSetResponse()

    @guarded
    async def KVGet(self, request: pb.KVGetRequest, context) -> pb.KVGetResponse:
        run_id = v.ident("run_id", request.run_id)
        keys = [v.key(f"keys[{i}]", k) for i, k in enumerate(v.batch("keys", request.keys))]
        wait_s = v.duration_ms("wait_ms", request.wait_ms)
        if wait_s > 0:
            return pb.KVGetResponse(values=await self.core.kv_wait(run_id, keys, wait_s))
        values, missing = self.core.kv_get(run_id, keys)
        return pb.KVGetResponse(values=[b"" if x is None else x for x in values], missing=missing)

    @guarded
    async def KVCompareSet(self, request: pb.KVCompareSetRequest, context) -> pb.KVCompareSetResponse:
        value, swapped = self.core.kv_compare_set(
            v.ident("run_id", request.run_id),
            v.key("key", request.key),
            v.value("expected", request.expected, self.max_kv_value_bytes),
            v.value("desired", request.desired, self.max_kv_value_bytes),
            **_write_opts(request),
        )
        return pb.KVCompareSetResponse(value=value, swapped=swapped)

    @guarded
    async def KVAdd(self, request: pb.KVAddRequest, context) -> pb.KVAddResponse:
        value = self.core.kv_add(v.ident("run_id", request.run_id), v.key("key", request.key), request.delta, **_write_opts(request))
        return pb.KVAddResponse(value=value)

    @guarded
    async def KVDelete(self, request: pb.KVDeleteRequest, context) -> pb.KVDeleteResponse:
        deleted = self.core.kv_delete(v.ident("run_id", request.run_id), v.key("key", request.key), **_write_opts(request))
        return pb.KVDeleteResponse(deleted=deleted)

    @guarded
    async def KVNumKeys(self, request: pb.KVNumKeysRequest, context) -> pb.KVNumKeysResponse:
        return pb.KVNumKeysResponse(count=self.core.kv_num_keys(v.ident("run_id", request.run_id)))

    # -- rendezvous --------------------------------------------------------------------------

    @guarded
    async def RoundJoin(self, request: pb.RoundJoinRequest, context) -> pb.RoundJoinResponse:
        run_id = v.ident("run_id", request.run_id)
        mid, inc = v.member_ref("member", request.member)
        c = request.config
        min_nodes, max_nodes = v.round_config("config", c.min_nodes, c.max_nodes)
        config = RoundConfig(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            last_call_s=v.duration_ms("config.last_call_ms", c.last_call_ms) if c.last_call_ms else DEFAULT_LAST_CALL_S,
            join_timeout_s=v.duration_ms("config.join_timeout_ms", c.join_timeout_ms) or DEFAULT_JOIN_TIMEOUT_S,
            rejoin_timeout_s=0.0 if c.rejoin_timeout_ms < 0
            else v.duration_ms("config.rejoin_timeout_ms", c.rejoin_timeout_ms) or DEFAULT_REJOIN_TIMEOUT_S,
        )
        result = await self.core.round_join(
            run_id,
            mid,
            inc,
            config,
            after_round=request.after_round,
            wait_s=v.duration_ms("wait_ms", request.wait_ms, allow_zero=False),
        )
        return pb.RoundJoinResponse(
            status=_ROUND_STATUS[result.status],
            round=result.round,
            rank=result.rank,
            world_size=len(result.participants),
            participants=result.participants,
            reason=result.reason,
            standby=result.standby,
        )

    @guarded
    async def CloseRun(self, request: pb.CloseRunRequest, context) -> pb.CloseRunResponse:
        self.core.close_run(v.ident("run_id", request.run_id), v.text("reason", request.reason, v.MAX_REASON_LEN))
        return pb.CloseRunResponse()

    # -- status ------------------------------------------------------------------------------

    @guarded
    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        if request.run_id:
            v.ident("run_id", request.run_id)
            runs = [self.core.runs[request.run_id]] if request.run_id in self.core.runs else []
        else:
            runs = sorted(self.core.runs.values(), key=lambda r: r.run_id)
        return pb.StatusResponse(
            runs=[
                pb.RunStatus(
                    snapshot=run_snapshot(self.core, run),
                    open_barriers=[_barrier_info(self.core, run, b) for b in run.open_barriers.values()],
                    departed=[member_info(self.core, m) for m in run.members.values() if not m.live]
                    if request.include_departed
                    else [],
                    kv_keys=len(run.kv),
                )
                for run in runs
            ],
            uptime_s=self.core.clock() - self.core.started_at,
            version=__version__,
            lease_ttl_ms=int(self.core.lease_ttl_s * 1000),
        )


try:  # what ``context.write`` raises once the client has gone (``context.done()`` is not yet true)
    from grpc._cython.cygrpc import ExecuteBatchError as _WRITE_FAILED
except ImportError:  # pragma: no cover - gRPC does not export it; another build may lack it
    class _WRITE_FAILED(Exception):  # noqa: N801 - never raised: a failed write ends the call as gRPC's does
        pass

# How long a response stream whose write failed waits for gRPC to see the client's close (it cancels
# the handler then, at once in practice); past it the failed write is raised and gRPC logs it.
_CLOSE_NEWS_S = 5.0
_GRPC_CORE_LOGGER = "grpc._cython.cygrpc"


class _UnsentReply(logging.Filter):
    """gRPC sends a unary reply after the handler returned; when the client has gone by then (a
    worker killed, a call past its deadline, a connection cut) before gRPC heard of its close, it
    logs the failed send as an ERROR with a traceback from its own core. That is the client's
    disconnect, not a fault of the coordinator's: this makes it one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, _WRITE_FAILED) and record.levelno >= logging.ERROR:
            record.msg, record.args = "%s: the reply was not sent, the client had gone (%s)", (record.getMessage(), exc)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


def quiet_unsent_replies() -> None:
    """Install ``_UnsentReply`` on gRPC's core logger (once)."""
    logger = logging.getLogger(_GRPC_CORE_LOGGER)
    if not any(isinstance(f, _UnsentReply) for f in logger.filters):
        logger.addFilter(_UnsentReply())


def _parsing(impl, request_cls, kind: str):
    """Wrap ``impl`` so undecodable bytes get INVALID_ARGUMENT naming the message type, rather
    than gRPC's default UNKNOWN. ``kind``: "unary", "server_stream", "client_stream" or "bidi" (for
    a request stream, each message is parsed as it comes and the first undecodable one ends the call)."""

    async def parse(raw: bytes, context):
        try:
            return request_cls.FromString(raw)
        except DecodeError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request is not a valid {request_cls.DESCRIPTOR.full_name}: {exc}",
            )

    async def write_all(items, context):
        # Written here rather than yielded to gRPC, so a write that fails because the client
        # went away mid-stream (a worker killed, or timed out mid-download) ends the call
        # quietly. gRPC logs a failed batch with a traceback unless it has already seen the
        # client's close; that news comes a moment after the failed write, as a cancel of this
        # task. So the handler waits for it rather than raising or returning at once (a return
        # would also make gRPC send the initial metadata a second time when the first write
        # failed, which core refuses with TOO_MANY_OPERATIONS, logged as well).
        try:
            async for item in items:
                try:
                    await context.write(item)
                except _WRITE_FAILED:
                    log.debug("%s: the client went away mid-stream", request_cls.DESCRIPTOR.full_name)
                    await asyncio.sleep(_CLOSE_NEWS_S)  # cancelled when the close comes
                    raise
        finally:
            await items.aclose()

    if kind == "bidi":

        async def bidi_handler(raw_requests, context):
            async def requests():
                async for raw in raw_requests:
                    yield await parse(raw, context)

            await write_all(impl(requests(), context), context)

        return bidi_handler

    if kind == "client_stream":

        async def client_stream_handler(raw_requests, context):
            async def requests():
                async for raw in raw_requests:
                    yield await parse(raw, context)

            return await impl(requests(), context)

        return client_stream_handler

    if kind == "server_stream":

        async def stream_handler(raw, context):
            await write_all(impl(await parse(raw, context), context), context)

        return stream_handler

    async def unary_handler(raw, context):
        return await impl(await parse(raw, context), context)

    return unary_handler


def _serialize(to_bytes, response) -> bytes:
    """A handler may hand back a response already serialized (see ``_session_arrive``)."""
    return response if isinstance(response, bytes) else to_bytes(response)


def add_to_server(servicer: CoordinatorServicer, server: grpc.aio.Server) -> None:
    """Register every Coordinator RPC with raw-bytes deserialization (see ``_parsing``)."""
    add_service(servicer, server, pb, "Coordinator")


def add_service(servicer, server: grpc.aio.Server, module, name: str) -> None:
    """Register every RPC of service ``name`` (defined in the generated ``module``) on ``server``."""
    service = module.DESCRIPTOR.services_by_name[name]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(module, method.input_type.name)
        response_cls = getattr(module, method.output_type.name)
        impl = getattr(servicer, method.name)
        serialize = functools.partial(_serialize, response_cls.SerializeToString)
        if method.client_streaming and method.server_streaming:
            handler = grpc.stream_stream_rpc_method_handler(_parsing(impl, request_cls, "bidi"), response_serializer=serialize)
        elif method.server_streaming:
            handler = grpc.unary_stream_rpc_method_handler(_parsing(impl, request_cls, "server_stream"), response_serializer=serialize)
        elif not method.client_streaming:
            handler = grpc.unary_unary_rpc_method_handler(_parsing(impl, request_cls, "unary"), response_serializer=serialize)
        else:
            handler = grpc.stream_unary_rpc_method_handler(_parsing(impl, request_cls, "client_stream"), response_serializer=serialize)
        handlers[method.name] = handler
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
