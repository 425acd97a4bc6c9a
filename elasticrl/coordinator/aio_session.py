"""A member's long-lived Session stream to the coordinator: keep-alives and barrier arrivals as
messages on one open bidi stream instead of one unary call each (a unary call costs the server
several times what a message on an open stream does).

``AsyncSession`` keeps the contract of the unary ``AsyncCoordinatorClient`` calls it replaces: the
same requests (``wire``), the same errors (``codes``), a deadline on every operation, and
reconnection when the coordinator restarts. Operations carry a client-chosen id; one reader task
resolves each operation's future by the id its response echoes (responses come out of order).
When the stream breaks with UNAVAILABLE (or the server ends it), the session reopens it with
``wire.retry_wait()`` backoff for at most ``reconnect_timeout_s`` and re-sends every operation in
flight (keep-alives and arrivals are idempotent); past that budget the pending operations fail
with ``CoordinatorUnavailableError`` and the next operation starts a fresh attempt.

One session may carry many members of its run (``member()``: a process hosting several members,
a node agent): their operations share the stream, and requests queued together go as one
``SessionBatch`` message, answered in batches too (grpc.aio's cost is per message, not per
operation); a lone request still goes as itself, so a one-member session's wire is unchanged.

``AsyncCoordinatorClient.session()`` builds one from its stub, metadata and timeouts; this module
does not import the client (the client imports it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl._proto import coordinator_pb2_grpc as pb_grpc
from elasticrl.coordinator import codes, wire
from elasticrl.coordinator.state import BarrierResult
from elasticrl.coordinator.wire import CLOSE_WAIT_S, DEADLINE_SLACK_S, MAX_WAIT_CHUNK_S
from elasticrl.errors import CoordinatorTimeoutError, CoordinatorUnavailableError, InternalError

log = logging.getLogger(__name__)


def worth_reopening(err: grpc.RpcError) -> bool:
    """A stream ending that a new stream may fix: the coordinator went away (UNAVAILABLE), ended
    the stream itself (CANCELLED: a graceful shutdown past its grace period), or grpc.aio made up
    an INTERNAL because a write lost the race with the stream's end (the coordinator's own
    INTERNAL always names its class in trailing metadata)."""
    code = err.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return True
    return code == grpc.StatusCode.INTERNAL and not any(k == codes.ERROR_KEY for k, _ in err.trailing_metadata() or ())


BATCH_MAX = 4096
"""Operations one batch message carries at most."""


async def batched_requests(outbox: asyncio.Queue):
    """The request iterator of one stream: what is put in ``outbox`` until a None ends it, every
    request already queued when the stream is ready for the next message going as one ``batch``
    (a lone request goes as itself, so a one-member session's wire is unchanged; ``close`` is never
    batched)."""
    nothing = held = object()  # ``held``: taken while batching but not batchable, sent next
    while True:
        request = await outbox.get() if held is nothing else held
        held = nothing
        if request is None:
            return
        if outbox.qsize() and request.WhichOneof("op") != "close":
            ops = [request]
            while len(ops) < BATCH_MAX and outbox.qsize():
                nxt = outbox.get_nowait()
                if nxt is None or nxt.WhichOneof("op") == "close":
                    held = nxt
                    break
                ops.append(nxt)
            if len(ops) > 1:
                # Each inner op keeps its id; ``extend`` copies, so the originals stay re-sendable.
                request = pb.SessionRequest(batch=pb.SessionBatch(ops=ops))
        yield request


class _Op:
    """One operation in flight: its request (re-sent as is after a reconnect) and its future."""

    __slots__ = ("request", "future", "timeout_s", "timer")

    def __init__(self, request: pb.SessionRequest, future: asyncio.Future, timeout_s: float):
        self.request = request
        self.future = future
        # Deadline from when the request goes on a stream; re-armed when it is re-sent.
        self.timeout_s = timeout_s
        self.timer: asyncio.TimerHandle | None = None


class AsyncSession:
    """One member's Session stream (and others', see ``member``). Use it from the event loop it
    was created on.

    Opened lazily by the first operation; ``close()`` ends the stream and fails what is pending.
    Raises the ``elasticrl.errors`` classes, like ``AsyncCoordinatorClient``.
    """

    def __init__(
        self,
        stub: pb_grpc.CoordinatorStub,
        run_id: str,
        member_id: str,
        incarnation: int,
        *,
        address: str,
        metadata: tuple[tuple[str, str], ...],
        call_timeout_s: float,
        reconnect_timeout_s: float,
    ):
        """``stub`` on a ``grpc.aio`` channel; ``metadata`` goes with every stream (the token);
        ``call_timeout_s`` bounds a keep-alive and opening a stream, ``reconnect_timeout_s`` how
        long a broken stream is reopened before pending operations fail."""
        self._stub = stub
        self._metadata = metadata
        self.address = address
        self.call_timeout_s = call_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.run_id = run_id
        self.member_id = member_id
        self.incarnation = incarnation
        self._keep_alive_request = pb.KeepAliveRequest(run_id=run_id, member=wire.member_ref(member_id, incarnation))
        self._ids = itertools.count(1)
        self._pending: dict[int, _Op] = {}
        # (member id, incarnation) -> its keep-alive: the members this session's streams carry.
        self._attached: dict[tuple[str, int], pb.KeepAliveRequest] = {}
        self._reopened = False  # a stream was up before: the next one is a reopening
        # Requests for the current stream; None while no stream is open (ops wait in _pending).
        self._outbox: asyncio.Queue | None = None
        self._runner: asyncio.Task | None = None
        self._closed = False
        # (barrier name, the last decided response decoded, its result): see ``_outcome``.
        self._last_outcome: tuple[str, pb.ArriveResponse, BarrierResult] | None = None

    # -- operations --------------------------------------------------------------------------

    async def keep_alive(self) -> int:
        """Renew the lease; returns the run's epoch (``FencedError`` if this incarnation is not live)."""
        return await self._keep_alive(self._keep_alive_request)

    async def arrive(self, name: str, *, timeout_s: float, policy: str = "evict_missing", epoch: int = 0) -> BarrierResult:
        """Arrive at barrier ``name`` and return once it is decided (``AsyncCoordinatorClient.arrive``'s contract).

        Raises ``BarrierTimeoutError`` (with ``.missing``) when the REPORT policy timed out, and
        ``CoordinatorTimeoutError`` if no decision came well after ``timeout_s``.
        """
        return await self._arrive(self.member_id, self.incarnation, name, timeout_s=timeout_s, policy=policy, epoch=epoch)

    def member(self, member_id: str, incarnation: int) -> "SessionMember":
        """Another joined member of the same run whose operations ride this session's stream.

        One process with many members (a node agent, a bench) then has one stream, and operations
        queued together go as one batch message (the coordinator answers in batches too): the
        cost of a message is paid once per batch instead of once per member. When the stream
        breaks without ``close``, every member that kept alive on it is evicted after the grace.
        """
        return SessionMember(self, member_id, incarnation)

    async def _keep_alive(self, request: pb.KeepAliveRequest) -> int:
        # A keep-alive attaches its member to the stream (a broken one gets it evicted after the
        # grace): remembered, so that a reopened stream attaches every member again at once.
        self._attached[(request.member.member_id, request.member.incarnation)] = request
        resp = await self._op(pb.SessionRequest(keep_alive=request), self.call_timeout_s)
        return resp.keep_alive.epoch

    async def _arrive(
        self, member_id: str, incarnation: int, name: str, *, timeout_s: float, policy: str = "evict_missing", epoch: int = 0,
    ) -> BarrierResult:
        give_up = time.monotonic() + timeout_s + DEADLINE_SLACK_S + self.reconnect_timeout_s
        while True:
            wait_s = max(0.05, min(MAX_WAIT_CHUNK_S, give_up - time.monotonic()))
            request = wire.arrive_request(
                self.run_id, member_id, incarnation, name,
                timeout_s=timeout_s, policy=policy, epoch=epoch, wait_s=wait_s,
            )
            resp = await self._op(pb.SessionRequest(arrive=request), wait_s + DEADLINE_SLACK_S)
            result = self._outcome(name, resp.arrive)
            if result is not None:
                return result
            if time.monotonic() >= give_up:
                raise CoordinatorTimeoutError(f"barrier {name!r} was not decided within {timeout_s:.3f}s")

    def _outcome(self, name: str, response: pb.ArriveResponse) -> BarrierResult | None:
        """``wire.arrive_outcome``, but the members of this session that get the same decided
        response share its decoding (each response lists every member: decoding it once per member
        made a release O(N^2) here); each still gets its own lists."""
        if response.outcome != pb.BARRIER_OUTCOME_COMPLETED:
            return wire.arrive_outcome(name, response)
        hit = self._last_outcome
        if hit is not None and hit[0] == name and (hit[1] is response or hit[1] == response):
            r = hit[2]
            return BarrierResult(r.outcome, list(r.arrived), list(r.evicted), list(r.missing), r.epoch, r.reason)
        result = wire.arrive_outcome(name, response)
        self._last_outcome = (name, response, result)
        return result

    async def close(self) -> None:
        """End the stream; operations still pending fail with ``CoordinatorUnavailableError``."""
        self._closed = True
        if self._outbox is not None and self._runner is not None and not self._runner.done():
            # Say so, then half-close: a stream that just ends reads as a crash to the coordinator.
            self._outbox.put_nowait(pb.SessionRequest(id=next(self._ids), close=pb.SessionClose()))
            self._outbox.put_nowait(None)
            # The coordinator ends the stream once its arrivals are answered: wait a little.
            await asyncio.wait({self._runner}, timeout=CLOSE_WAIT_S)
        if self._runner is not None:
            self._runner.cancel()
            try:
                await self._runner
            except asyncio.CancelledError:
                pass
        self._fail_pending(CoordinatorUnavailableError(f"session to {self.address} was closed"))

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- machinery ---------------------------------------------------------------------------

    async def _op(self, request: pb.SessionRequest, timeout_s: float) -> pb.SessionResponse:
        """Send one operation and await its response; an ``Error`` response is raised mapped."""
        if self._closed:
            raise RuntimeError(f"session of {self.member_id} to {self.address} is closed")
        request.id = next(self._ids)
        op = _Op(request, asyncio.get_running_loop().create_future(), timeout_s)
        self._pending[request.id] = op
        if self._outbox is not None:
            self._send(op)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run(), name=f"session-{self.member_id}")
        try:
            resp = await op.future
        finally:
            self._forget(request.id)
        if resp.HasField("error"):
            raise codes.error_from_session(resp.error, self.address)
        return resp

    def _resolve(self, request_id: int, resp: pb.SessionResponse) -> None:
        op = self._pending.get(request_id)
        if op is not None and not op.future.done():
            op.future.set_result(resp)
        # else: the answer to an operation that already timed out or was cancelled

    def _send(self, op: _Op) -> None:
        self._outbox.put_nowait(op.request)
        if op.timer is not None:
            op.timer.cancel()
        op.timer = asyncio.get_running_loop().call_later(op.timeout_s, self._expire, op)

    def _expire(self, op: _Op) -> None:
        if not op.future.done():
            what = op.request.WhichOneof("op")
            op.future.set_exception(
                CoordinatorTimeoutError(f"session {what} to {self.address}: no answer within {op.timeout_s:.3f}s")
            )

    def _forget(self, request_id: int) -> None:
        op = self._pending.pop(request_id, None)
        if op is not None and op.timer is not None:
            op.timer.cancel()

    def _fail_pending(self, exc: Exception) -> None:
        for request_id, op in list(self._pending.items()):
            if not op.future.done():
                op.future.set_exception(exc)
            self._forget(request_id)

    async def _run(self) -> None:
        try:
            await self._serve_streams()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug here must not leave operations hanging
            log.exception("session %s to %s failed", self.member_id, self.address)
            self._fail_pending(InternalError(f"session to {self.address} failed: {type(exc).__name__}: {exc}"))

    async def _serve_streams(self) -> None:
        """Keep a stream open; reopen it after transport failures, within the reconnect budget."""
        budget = wire.ReopenBudget(self.reconnect_timeout_s)
        while True:
            was_up, detail = await self._one_stream()
            if detail is None or self._closed:
                return  # a failure a new stream cannot fix: pending operations got its error
            pause = budget.pause_after(was_up)
            if pause is None:
                self._fail_pending(CoordinatorUnavailableError(
                    f"coordinator at {self.address} is unreachable: session stream not reopened within "
                    f"{self.reconnect_timeout_s:.1f}s ({detail})"
                ))
                return  # the next operation starts a fresh attempt
            log.debug("session %s to %s broke (%s); reopening in %.3fs", self.member_id, self.address, detail, pause)
            await asyncio.sleep(pause)

    async def _one_stream(self) -> tuple[bool, str | None]:
        """Open a stream, (re-)send what is pending, dispatch responses until the stream ends.

        Returns (whether it was up, why it ended) when a new stream may help; fails the pending
        operations and returns (_, None) when not. The stream has no gRPC deadline (it lives as
        long as the member): each operation has its own, armed while it is on an open stream,
        opening has ``call_timeout_s``, and the channel's keepalive pings notice a dead peer.
        """
        outbox: asyncio.Queue = asyncio.Queue()
        call = self._stub.Session(batched_requests(outbox), metadata=self._metadata)
        up = False
        try:
            # The server sends initial metadata as soon as the stream is up. Nothing is written
            # before that, so a refused stream (token) never races a write with its status.
            try:
                async with asyncio.timeout(self.call_timeout_s):
                    await call.initial_metadata()
            except TimeoutError:
                call.cancel()
                return False, f"stream not opened within {self.call_timeout_s:.1f}s"
            if not call.done():
                up = True
                self._outbox = outbox
                # Every member kept alive on an earlier stream first: a member is attached to a
                # stream by a keep-alive, and one whose stream broke is evicted after the stream
                # grace unless one arrives on a new stream (its answer is not waited for).
                for request in self._attached.values() if self._reopened else ():
                    outbox.put_nowait(pb.SessionRequest(id=next(self._ids), keep_alive=request))
                self._reopened = True
                for op in list(self._pending.values()):
                    self._send(op)  # in flight when the last stream broke, or queued meanwhile
            async for resp in call:
                if resp.WhichOneof("result") == "batch":
                    for one in resp.batch.results:
                        self._resolve(one.id, one)
                    for group in resp.batch.shared:  # one response for many ids
                        one = group.response
                        for request_id in group.ids:
                            self._resolve(request_id, one)
                else:
                    self._resolve(resp.id, resp)
            return up, "the coordinator ended the stream"
        except grpc.RpcError as err:
            if worth_reopening(err):
                return up, err.details() or err.code().name
            self._fail_pending(codes.error_from_rpc(err, self.address))
            return up, None
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            self._outbox = None
            outbox.put_nowait(None)  # ends this stream's request generator
            for op in self._pending.values():
                if op.timer is not None:
                    op.timer.cancel()  # off the wire: the reconnect budget bounds it now
                    op.timer = None


class SessionMember:
    """One member's view of a shared ``AsyncSession`` (``AsyncSession.member``): the same calls as
    a session of its own, sent on the owning session's stream."""

    __slots__ = ("session", "member_id", "incarnation", "_keep_alive_request")

    def __init__(self, session: AsyncSession, member_id: str, incarnation: int):
        self.session = session
        self.member_id = member_id
        self.incarnation = incarnation
        self._keep_alive_request = pb.KeepAliveRequest(run_id=session.run_id, member=wire.member_ref(member_id, incarnation))

    async def keep_alive(self) -> int:
        """Renew this member's lease on the shared stream (see ``AsyncSession.keep_alive``)."""
        return await self.session._keep_alive(self._keep_alive_request)

    async def arrive(self, name: str, *, timeout_s: float, policy: str = "evict_missing", epoch: int = 0) -> BarrierResult:
        """Arrive at barrier ``name`` as this member (see ``AsyncSession.arrive``)."""
        return await self.session._arrive(
            self.member_id, self.incarnation, name, timeout_s=timeout_s, policy=policy, epoch=epoch
        )
