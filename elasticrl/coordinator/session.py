"""The Session stream of the Coordinator service: one stream carries the keep-alives and barrier
arrivals of one member, or of every member a process hosts (``SessionBatch``).

Keep-alives are answered inline. A message's arrivals are recorded together
(``CoordinatorCore.arrive_together``: one SQLite transaction for every message read in one turn
of the event loop, not one per member); those whose
barrier is still open wait in this stream's ``StreamArrivals``, which listens once per barrier,
so a barrier's release puts one item on the stream (every id it answers, and the decided answer
serialized once) instead of waking a task per member. Every response goes through ``out``, whose
one consumer (the handler's generator) is the stream's only writer; once a client has sent a
batch, the writer sends every response already queued as one batch message, a decided answer
once per message for all of its ids.

Memory per stream is bounded: ``out`` holds at most SESSION_MAX_PENDING responses and the reader
waits for room (so a client that does not read stops being read: backpressure), and at most
SESSION_MAX_ARRIVALS arrivals wait at once. An answer that finds ``out`` full (a release, an
expired wait, a fenced waiter) waits for room in a task of its own, and counts as waiting until
then. Neither wait can deadlock: the only thing that frees room is the client reading, and a
client that reads gets every response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import grpc

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl.coordinator import validate as v
from elasticrl.coordinator.barriers import DEFAULT_BARRIER_TIMEOUT_S, Arrival
from elasticrl.coordinator.core import CoordinatorCore
from elasticrl.coordinator.state import BarrierResult, Outcome, TimeoutPolicy
from elasticrl.errors import InternalError, InvalidRequestError, ResourceLimitError

log = logging.getLogger(__name__)

# A Session stream's responses not yet taken by gRPC: past this many, the stream's requests are not
# read until there is room, so a client that does not read its responses holds the coordinator's
# memory to a bound (then HTTP/2 flow control stops its writes).
SESSION_MAX_PENDING = 1024
# Arrivals one Session stream may have waiting at once; one more is answered RESOURCE_EXHAUSTED
# (a member waits at one barrier at a time, or a few).
SESSION_MAX_ARRIVALS = 1024
# Responses one batch message carries at most, on a stream whose client batches.
SESSION_BATCH_MAX = 4096
# ... and bytes, well under the message limits (64 MiB by default, less where a client sets it): a
# decided arrival's answer lists every member, so 1024 of them at 4096 members make 32 MiB.
SESSION_BATCH_BYTES = 1 << 20

POLICY = {
    pb.TIMEOUT_POLICY_UNSPECIFIED: TimeoutPolicy.EVICT_MISSING,
    pb.TIMEOUT_POLICY_EVICT_MISSING: TimeoutPolicy.EVICT_MISSING,
    pb.TIMEOUT_POLICY_REPORT: TimeoutPolicy.REPORT,
}


def parse_arrival(request: pb.ArriveRequest) -> tuple[Arrival, float]:
    """The validated arrival and its wait in seconds (0: until decided). Raises ``InvalidRequestError``."""
    run_id = v.ident("run_id", request.run_id)
    mid, inc = v.member_ref("member", request.member)
    if request.policy not in POLICY:
        raise InvalidRequestError(f"policy: unknown value {request.policy}; expected EVICT_MISSING or REPORT")
    timeout_s = v.duration_ms("timeout_ms", request.timeout_ms) or DEFAULT_BARRIER_TIMEOUT_S
    arrival = Arrival(run_id, mid, inc, v.name("name", request.name), request.epoch, timeout_s, POLICY[request.policy])
    return arrival, v.duration_ms("wait_ms", request.wait_ms)


def arrive_response(result: BarrierResult | None, epoch: int) -> pb.ArriveResponse:
    if result is None:
        return pb.ArriveResponse(outcome=pb.BARRIER_OUTCOME_PENDING, epoch=epoch, reason="still waiting")
    outcome = pb.BARRIER_OUTCOME_COMPLETED if result.outcome is Outcome.COMPLETED else pb.BARRIER_OUTCOME_TIMED_OUT
    return pb.ArriveResponse(
        outcome=outcome,
        arrived=result.arrived,
        evicted=result.evicted,
        missing=result.missing,
        epoch=result.epoch,
        reason=result.reason,
    )


@dataclasses.dataclass
class Release:
    """The decided answer of one barrier for request ``ids`` of one stream: ``wrapped`` is that
    answer as a serialized SessionResponse without id, shared by every member and stream."""

    ids: list[int]
    wrapped: bytes


@dataclasses.dataclass
class _Waiting:
    request_id: int
    arrival: Arrival
    deadline: float | None  # loop time after which it is answered PENDING; None: until decided


class StreamArrivals:
    """The arrivals waiting on one Session stream, by barrier: one listener and at most one timer
    per barrier, whatever the number of members waiting there."""

    def __init__(
        self, core: CoordinatorCore, out: asyncio.Queue, decided: Callable[[tuple[str, str], BarrierResult], bytes],
        error: Callable[[int, Exception], pb.SessionResponse],
    ):
        self.core = core
        self.out = out
        self._decided = decided  # the shared serialized answer of a decided barrier
        self._error = error
        self._waiting: dict[tuple[str, str], list[_Waiting]] = {}
        self._listening: dict[tuple[str, str], int] = {}
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._puts: set[asyncio.Task] = set()
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()

    async def arrive(self, ops: list[tuple[int, pb.ArriveRequest]]) -> None:
        """Record the arrivals of one message, answer those decided or refused, keep the rest."""
        arrivals: list[tuple[int, Arrival, float]] = []
        for request_id, request in ops:
            try:
                waiting = self.count + len(self._puts) + len(arrivals)  # parked answers hold their place
                if waiting >= SESSION_MAX_ARRIVALS:
                    raise ResourceLimitError(
                        f"arrive: {waiting} arrivals already wait on this session (limit "
                        f"{SESSION_MAX_ARRIVALS}); read their answers before arriving again"
                    )
                arrivals.append((request_id, *parse_arrival(request)))
            except Exception as exc:  # noqa: BLE001 - this operation's Error, never the stream's
                await self.out.put(self._error(request_id, exc))
        if not arrivals:
            return
        results = await self.core.arrive_together([a for _, a, _ in arrivals])
        released: dict[bytes, list[int]] = {}
        errors = []
        now = asyncio.get_running_loop().time()
        for (request_id, arrival, wait_s), result in zip(arrivals, results):
            if result is None:  # (see BarrierOps.arrive: decided, or fenced, since the commit answered)
                try:
                    result = self.core.arrival_result(arrival)
                except Exception as exc:  # noqa: BLE001 - FencedError: this arrival's answer
                    result = exc
            if isinstance(result, Exception):
                errors.append(self._error(request_id, result))
            elif result is not None:
                released.setdefault(self._decided((arrival.run_id, arrival.name), result), []).append(request_id)
            else:
                self._wait(_Waiting(request_id, arrival, now + wait_s if wait_s > 0 else None))
        for wrapped, ids in released.items():
            await self.out.put(Release(ids, wrapped))
        for response in errors:
            await self.out.put(response)

    def _wait(self, w: _Waiting) -> None:
        key = (w.arrival.run_id, w.arrival.name)
        waiting = self._waiting.get(key)
        if waiting is None:
            waiting = self._waiting[key] = []
            self._listening[key] = self.core.listen(*key, lambda: self._released(key))
        waiting.append(w)
        self.count += 1
        self.idle.clear()
        if w.deadline is not None:
            timer = self._timers.get(key)
            if timer is None or w.deadline < timer.when():
                if timer is not None:
                    timer.cancel()
                self._timers[key] = asyncio.get_running_loop().call_at(w.deadline, self._expire, key)

    def _take(self, key: tuple[str, str], keep: Callable[[_Waiting], bool] = lambda w: False) -> list[_Waiting]:
        """Remove and return the arrivals waiting at ``key`` that ``keep`` does not keep."""
        waiting = self._waiting.get(key, [])
        taken = [w for w in waiting if not keep(w)]
        left = [w for w in waiting if keep(w)] if len(taken) < len(waiting) else []
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if left:
            self._waiting[key] = left
            deadlines = [w.deadline for w in left if w.deadline is not None]
            if deadlines:
                self._timers[key] = asyncio.get_running_loop().call_at(min(deadlines), self._expire, key)
        else:
            self._waiting.pop(key, None)
            handle = self._listening.pop(key, None)
            if handle is not None:
                self.core.unlisten(*key, handle)
        self.count -= len(taken)
        if not self.count:
            self.idle.set()
        return taken

    def _released(self, key: tuple[str, str]) -> None:
        """Barrier ``key`` was decided (called from inside the decision): answer its waiters."""
        self._listening.pop(key, None)  # a listener is called once
        taken = self._take(key)
        run = self.core.runs.get(key[0])
        ids, items = [], []
        for w in taken:
            try:
                result = self.core.arrival_result(w.arrival)  # FencedError if evicted while waiting
            except Exception as exc:  # noqa: BLE001 - that member's Error
                items.append(self._error(w.request_id, exc))
                continue
            if result is None:  # cannot happen once decided; answered PENDING, the client asks again
                items.append(pb.SessionResponse(id=w.request_id, arrive=arrive_response(None, run.epoch if run else 0)))
            else:
                ids.append(w.request_id)
        if ids:
            barrier = run.barriers[key[1]]
            items.insert(0, Release(ids, self._decided(key, barrier.result)))
        for item in items:
            self._put(item)

    def _expire(self, key: tuple[str, str]) -> None:
        """The waits that ran out at ``key`` are answered PENDING (the client arrives again)."""
        self._timers.pop(key, None)
        now = asyncio.get_running_loop().time()
        run = self.core.runs.get(key[0])
        for w in self._take(key, keep=lambda w: w.deadline is None or w.deadline > now):
            self._put(pb.SessionResponse(id=w.request_id, arrive=arrive_response(None, run.epoch if run else 0)))

    def _put(self, item) -> None:
        try:
            self.out.put_nowait(item)
        except asyncio.QueueFull:  # the client is not reading: wait for room, off this callback
            task = asyncio.get_running_loop().create_task(self.out.put(item))
            self._puts.add(task)
            task.add_done_callback(self._puts.discard)

    async def drained(self) -> None:
        """Until no arrival waits and every answer is in ``out`` (the end of the stream goes after)."""
        await self.idle.wait()
        while self._puts:
            await asyncio.wait(set(self._puts))

    def close(self) -> None:
        """The stream ended: arrivals still waiting are dropped (their client re-arrives)."""
        for key in list(self._waiting):
            self._take(key)
        for task in list(self._puts):
            task.cancel()


async def serve(
    core: CoordinatorCore, requests, context, *, keep_alive: Callable[[int, pb.KeepAliveRequest], pb.SessionResponse],
    decided: Callable[[tuple[str, str], BarrierResult], bytes], error: Callable[[int, Exception], pb.SessionResponse],
    abort: Callable,
):
    """The Session handler's body (see the module docstring); yields serialized responses.
    ``keep_alive``, ``decided`` and ``error`` are the servicer's: a keep-alive's response, a
    decided barrier's shared answer, an operation's Error."""
    out: asyncio.Queue = asyncio.Queue(maxsize=SESSION_MAX_PENDING)
    arrivals = StreamArrivals(core, out, decided, error)
    # The members whose keep-alives this stream carries: when it breaks instead of being closed by
    # the client, the coordinator evicts them unless they reopen one within the grace.
    members: set[tuple[str, str, int]] = set()
    state = _ReadState()
    # Initial metadata now, not with the first response: it tells the client the stream is up.
    await context.send_initial_metadata(())
    reader = asyncio.create_task(_read(requests, out, arrivals, members, state, keep_alive, error, core), name="session-read")
    held = _NOTHING  # taken from ``out`` while batching but not a response: handled next
    try:
        while True:
            item, held = (await out.get() if held is _NOTHING else held), _NOTHING
            if state.batched and _is_response(item) and (out.qsize() or (isinstance(item, Release) and len(item.ids) > 1)):
                # Every response already queued goes as one message: grpc.aio's cost is per message.
                item, held = response_batch(item, out)
            if isinstance(item, Release):  # not batching: a message per id
                head = pb.SessionResponse(id=item.ids[0]).SerializeToString() + item.wrapped
                for request_id in item.ids[1:]:
                    yield head
                    head = pb.SessionResponse(id=request_id).SerializeToString() + item.wrapped
                item = head
            if isinstance(item, grpc.aio.AbortError):
                raise item  # an undecodable message: its status is already sent
            if isinstance(item, BaseException):  # a bug in the reader: logged, INTERNAL
                log.exception("session stream failed: %s", type(item).__name__, exc_info=item)
                # named InternalError, so the client tells it from a transport failure
                await abort(context, InternalError(f"internal error: {type(item).__name__}: {item}"))
            if item is None:
                return  # the client half-closed and every arrival was answered
            yield item
    finally:
        reader.cancel()
        arrivals.close()
        for key in members:
            # Not "the reader saw the end of the requests": a killed client's reset often reads
            # as one (a half-close) before grpc cancels this handler.
            core.stream_detached(*key, abrupt=not state.said_close)


@dataclasses.dataclass
class _ReadState:
    said_close: bool = False  # the client sent ``close``: it ended the stream on purpose
    batched: bool = False  # the client sent a ``batch``: responses may go batched too


async def _read(requests, out: asyncio.Queue, arrivals: StreamArrivals, members: set, state: _ReadState,
                keep_alive, error, core: CoordinatorCore) -> None:
    try:
        async for request in requests:
            op = request.WhichOneof("op")
            if op == "batch":
                state.batched = True
                waiting = []
                for inner in request.batch.ops:
                    kind = inner.WhichOneof("op")
                    if kind == "arrive":
                        waiting.append((inner.id, inner.arrive))
                    else:
                        await _op(inner, kind, out, members, keep_alive, error, core, inner=True)
                if waiting:
                    await arrivals.arrive(waiting)
            elif op == "close":
                state.said_close = True
            elif op == "arrive":
                await arrivals.arrive([(request.id, request.arrive)])
            else:
                await _op(request, op, out, members, keep_alive, error, core, inner=False)
        await arrivals.drained()
        await out.put(None)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - handed to the writer, which ends the stream
        await out.put(exc)


async def _op(request: pb.SessionRequest, op: str | None, out: asyncio.Queue, members: set, keep_alive, error,
              core: CoordinatorCore, *, inner: bool) -> None:
    """A keep-alive or a relay's detach, alone or from a batch (``inner``); anything else but an
    arrival is an error."""
    if op == "detach":
        await _detach(request, out, members, error, core)
    elif op == "keep_alive":
        # Waits while ``out`` is full: the next request is read only when there is room.
        response = keep_alive(request.id, request.keep_alive)
        if not response.HasField("error"):
            ka = request.keep_alive
            key = (ka.run_id, ka.member.member_id, ka.member.incarnation)
            if key not in members:
                members.add(key)
                core.stream_attached(*key)
        await out.put(response)
    else:
        what = ("inside a batch: must be keep_alive, arrive or detach" if inner
                else "must be set (keep_alive, arrive, close or detach)")
        await out.put(error(request.id, InvalidRequestError(f"op: {what}")))


async def _detach(request: pb.SessionRequest, out: asyncio.Queue, members: set, error, core: CoordinatorCore) -> None:
    """A relay's member left it: its session on this stream ends as its own stream would."""
    d = request.detach
    try:
        key = (v.ident("detach.run_id", d.run_id), *v.member_ref("detach.member", d.member))
    except InvalidRequestError as exc:
        await out.put(error(request.id, exc))
        return
    if key in members:
        members.discard(key)
        core.stream_detached(*key, abrupt=d.broken)


_NOTHING = object()


def _is_response(item) -> bool:
    return isinstance(item, (Release, pb.SessionResponse))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def response_batch(first, out: asyncio.Queue):
    """``first`` and the responses queued after it in ``out`` (up to SESSION_BATCH_MAX of them or
    about SESSION_BATCH_BYTES) as one serialized SessionResponse(batch=...), and what was taken
    from ``out`` that is not a response (or ``_NOTHING``). Built from serialized parts: a result is
    field 1 of SessionResponseBatch, a decided answer goes once per batch with all its ids
    (field 2, SharedSessionResponse), and the batch is field 5 of SessionResponse.

    This writes protobuf's wire format by hand (it is stable and documented) to avoid building
    and copying a message per member; ``tests/unit/test_session_batching.py`` parses the result
    with protobuf itself, so a change to those messages in the proto must be made here too."""
    parts, shared, size, count, item, held = [], {}, 0, 0, first, _NOTHING
    while True:
        if isinstance(item, Release):
            ids = shared.get(item.wrapped)  # bytes cache their hash: O(1) after the first
            if ids is None:
                ids = shared[item.wrapped] = []
                size += len(item.wrapped)
            ids.extend(item.ids)
            count += len(item.ids)
            size += 5 * len(item.ids)
        else:
            data = item.SerializeToString()
            parts.append(b"\x0a" + _varint(len(data)) + data)
            size += len(data)
            count += 1
        if count >= SESSION_BATCH_MAX or size >= SESSION_BATCH_BYTES or not out.qsize():
            break
        item = out.get_nowait()
        if not _is_response(item):
            held = item
            break
    if count == 1:
        return first, held
    for wrapped, ids in shared.items():
        packed = b"".join(map(_varint, ids))
        body = b"\x0a" + _varint(len(packed)) + packed + b"\x12" + _varint(len(wrapped)) + wrapped
        parts.append(b"\x12" + _varint(len(body)) + body)
    inner = b"".join(parts)
    return b"\x2a" + _varint(len(inner)) + inner, held
