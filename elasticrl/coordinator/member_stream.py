"""One member's Session stream for threaded code (``client.Membership``): its keep-alives and its
barrier arrivals on one open bidi stream.

A trainer worker keeps this stream open anyway (a keep-alive every TTL/3, so that its death is
noticed within the coordinator's stream grace). Its barrier arrivals used to be unary ``Arrive``
calls beside it; a unary call costs the coordinator several times what a message on an open
stream does (``bench/coordinator.py``: at 64 members a barrier's p50 was 11.4 ms over unary calls
and 6.8 ms over streams, at 512 members 108 and 56 ms). Now an arrival is a message on the stream,
answered by its id; while the stream is down (not opened yet, or reopening after the coordinator
restarted) it goes as a unary call, as before. Arrivals are idempotent, so one sent again after the
stream broke counts once.

Under torchrun the stream goes through the node's session relay (``session_relay.py``, run by
the agent: one stream per node to the coordinator), where the arriving thread writes its arrival
to the relay's socket itself; a member that cannot reach the relay streams directly.

``MemberStream.run`` (the member's renewal thread) keeps the stream open until ``stop`` (then
``wake``); ``MemberStream.arrive`` (any thread) sends one arrival and waits for its answer.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl.coordinator import codes, wire
from elasticrl.coordinator.session_relay import RelayCall
from elasticrl.errors import CoordinatorTimeoutError, FencedError
from elasticrl.repeats import Repeats

log = logging.getLogger(__name__)


_END = object()  # put in an outbox whose stream is over: its request iterator returns


class _Answer:
    __slots__ = ("done", "response")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.response: pb.SessionResponse | None = None  # None once done: the stream broke first


class MemberStream:
    def __init__(self, client, run_id: str, member_id: str, incarnation: int, *, period_s: float,
                 stop: threading.Event, on_epoch: Callable[[int], None], relay: str | None = None):
        self.client, self.run_id, self.member_id = client, run_id, member_id
        self.relay = relay or None  # the node's session relay's socket: the stream goes through it
        self._relay_failed = False
        self.period_s, self.stop, self.on_epoch = period_s, stop, on_epoch
        self._keep_alive = pb.KeepAliveRequest(run_id=run_id, member=wire.member_ref(member_id, incarnation))
        self._ids = itertools.count(1)  # request ids, keep-alives and arrivals alike
        self._outbox: queue.SimpleQueue | None = None  # the open stream's, once it answered
        self._put: Callable[[pb.SessionRequest], None] | None = None  # how an arrival goes on it
        self._current: queue.SimpleQueue | None = None  # the stream's being opened or open (for wake)
        self._call = None  # the open stream (for cancel)
        self._cancelled = False
        self._waiting: dict[int, _Answer] = {}
        self._lock = threading.Lock()

    def arrive(self, request: pb.ArriveRequest, timeout_s: float) -> pb.SessionResponse | None:
        """Send ``request`` on the stream and wait up to ``timeout_s`` for its answer (an
        ``arrive`` or an ``error`` response). None when no stream is up, or it broke meanwhile:
        send the arrival another way.

        Raises:
            CoordinatorTimeoutError: the stream stayed up and silent for ``timeout_s``, as a unary
                call past its deadline (a unary call after it took as long again).
        """
        answer, rid = _Answer(), next(self._ids)
        with self._lock:
            put = self._put
            if put is None:
                return None
            self._waiting[rid] = answer
        try:
            put(pb.SessionRequest(id=rid, arrive=request))
        except OSError:  # the relay's connection just went
            answer.done.set()
        answered = answer.done.wait(timeout_s)
        with self._lock:
            self._waiting.pop(rid, None)
        if not answered and answer.response is None:
            raise CoordinatorTimeoutError(
                f"coordinator at {self.client.address} did not answer the arrival at barrier {request.name!r} within {timeout_s:.3f}s"
            )
        return answer.response

    def run(self) -> None:
        """Keep a stream open, a keep-alive every ``period_s``, until ``stop`` is set (then it is
        closed cleanly). A broken stream is reopened at once, then with backoff. Raises
        ``FencedError`` once the incarnation is fenced."""
        budget = wire.ReopenBudget(float("inf"))
        outage = Repeats(10.0)  # while the coordinator stays unreachable: a warning every 10 s, not each reopen
        while not self.stop.is_set():
            outbox: queue.SimpleQueue = queue.SimpleQueue()
            with self._lock:
                self._current = outbox
            up = False
            try:
                call = self._open(self._requests(outbox))
                with self._lock:
                    self._call = call
                    cancelled = self._cancelled
                if cancelled:  # ``cancel`` came while it opened
                    call.cancel()
                for resp in call:
                    if not up:
                        up = True
                        with self._lock:
                            self._outbox = outbox
                            # Through a relay the arriving thread writes itself: one thread hop less.
                            self._put = call.send if isinstance(call, RelayCall) else outbox.put
                    self._answer(call, resp)
                detail = "the coordinator ended the stream"
            except grpc.RpcError as err:
                detail = f"{err.code().name}: {err.details()}"
            except OSError as err:  # the relay's connection
                detail = f"{type(err).__name__}: {err}"
            finally:
                self._broke(outbox)
            if self.stop.is_set():
                return
            pause = budget.pause_after(up)
            if up:
                outage.ok()  # it was up: reopened at once, as a rule
            note = None if up else outage.take()
            log.log(logging.DEBUG if note is None else logging.WARNING, "member %s: session stream to %s broke (%s); reopening in %.2fs%s",
                    self.member_id, self.client.address, detail, pause, "" if note is None else note.outage())
            if self.stop.wait(pause):
                return

    def _open(self, requests: Iterator[pb.SessionRequest]):
        """The stream: through the node relay when there is one and it answers, else straight to
        the coordinator (a relay that went away must not cost the member its lease)."""
        if self.relay is not None:
            try:
                call = RelayCall(self.relay, requests)
            except OSError as exc:
                if not self._relay_failed:
                    log.warning("member %s: session relay %s unreachable (%s); streaming to the coordinator directly",
                                self.member_id, self.relay, exc)
                self._relay_failed = True
            else:
                if self._relay_failed:
                    log.info("member %s: session relay %s is back", self.member_id, self.relay)
                self._relay_failed = False
                return call
        return self.client._stub.Session(requests, metadata=self.client._metadata)

    def _requests(self, outbox: queue.SimpleQueue) -> Iterator[pb.SessionRequest]:
        """A keep-alive now and every ``period_s``, and each arrival put in ``outbox``; a ``close``
        once ``stop`` is set (None in the outbox wakes this up)."""
        while True:
            yield pb.SessionRequest(id=next(self._ids), keep_alive=self._keep_alive)
            next_keep_alive = time.monotonic() + self.period_s
            while True:
                due = next_keep_alive - time.monotonic()
                try:
                    item = outbox.get(timeout=due) if due > 0 else None
                except queue.Empty:
                    item = None
                if self.stop.is_set():
                    # On purpose, said so: without it the coordinator takes the end for a crash.
                    yield pb.SessionRequest(id=next(self._ids), close=pb.SessionClose())
                    return  # half-close: the coordinator ends the stream cleanly
                if item is _END:
                    return
                if item is None:
                    break  # time for the next keep-alive
                yield item

    def _answer(self, call, resp: pb.SessionResponse) -> None:
        with self._lock:
            answer = self._waiting.pop(resp.id, None)
        if answer is not None:  # an arrival's
            answer.response = resp
            answer.done.set()
            return
        if resp.HasField("keep_alive"):
            self.on_epoch(resp.keep_alive.epoch)
        elif resp.HasField("error"):
            exc = codes.error_from_session(resp.error, self.client.address)
            if isinstance(exc, FencedError):
                call.cancel()
                raise exc
            log.warning("member %s: keep-alive failed (%s); retrying", self.member_id, exc)

    def _broke(self, outbox: queue.SimpleQueue) -> None:
        """The stream is gone: every arrival waiting on it is answered None (sent again)."""
        with self._lock:
            if self._outbox is outbox:
                self._outbox = self._put = None
            waiting, self._waiting = self._waiting, {}
        for answer in waiting.values():
            answer.done.set()
        outbox.put(_END)  # ends the request iterator if grpc still reads it

    def wake(self) -> None:
        """After ``stop`` was set from another thread: close the stream now, not at the next
        keep-alive."""
        with self._lock:
            outbox = self._current
        if outbox is not None:
            outbox.put(None)

    def cancel(self) -> None:
        """After ``stop``: end the stream now, without waiting for the coordinator to end it (it
        answers the arrivals still waiting on it first: a stopping member's may wait for a barrier
        decision). Those arrivals are answered None. The ``close`` already sent keeps it from
        reading as a crash."""
        with self._lock:
            call, self._cancelled = self._call, True
        if call is not None:
            call.cancel()
