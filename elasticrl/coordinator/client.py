"""Synchronous client of the coordinator, and ``Membership``: a joined member that keeps its lease.

Every call has a gRPC deadline. A call that finds the coordinator unreachable (UNAVAILABLE, e.g.
while it restarts after ``kill -9``) is retried with jittered exponential backoff (tenacity) for at
most ``reconnect_timeout_s`` in all, then raises ``CoordinatorUnavailableError`` naming the
address. Every other gRPC error becomes its ``elasticrl.errors`` class in ``codes``.

Blocking operations (barriers, KV waits, rendezvous rounds) are made of short server-side waits
(``wait_ms``) that the client repeats until its own deadline, so a coordinator restart in the
middle of a barrier only costs one retried, idempotent arrival.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import tenacity

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl._proto import coordinator_pb2_grpc as pb_grpc
from elasticrl.coordinator import codes, wire
from elasticrl.coordinator.member_stream import MemberStream
from elasticrl.coordinator.session_relay import ENV as RELAY_ENV
from elasticrl.coordinator.session_relay import FOR_ENV as RELAY_FOR_ENV
from elasticrl.coordinator.state import DEFAULT_REJOIN_TIMEOUT_S, BarrierResult, RoundResult
from elasticrl.coordinator.wire import CLOSE_WAIT_S, DEADLINE_SLACK_S, MAX_WAIT_CHUNK_S
from elasticrl.errors import (
    CoordinatorTimeoutError,
    CoordinatorUnavailableError,
    FencedError,
)

log = logging.getLogger(__name__)

CHECKED_WAIT_CHUNK_S = 0.5
"""How often a barrier wait with a ``check`` runs it, seconds (one re-arrival per chunk)."""

TOKEN_ENV = "ELASTICRL_TOKEN"
_ROUND_STATUS = {
    pb.ROUND_STATUS_COMPLETE: "complete",
    pb.ROUND_STATUS_WAITING: "waiting",
    pb.ROUND_STATUS_TIMED_OUT: "timed_out",
    pb.ROUND_STATUS_CLOSED: "closed",
}


def resolve_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The token to send: explicit value, else the file's first line, else $ELASTICRL_TOKEN."""
    if token:
        return token
    if token_file:
        return wire.read_token_file(token_file) or None
    return os.environ.get(TOKEN_ENV) or None


@dataclasses.dataclass(frozen=True)
class JoinResult:
    run_id: str
    member_id: str
    incarnation: int
    epoch: int
    lease_ttl_s: float


@dataclasses.dataclass(frozen=True)
class RoundView:
    round: int
    participants: tuple[str, ...]
    waiting: tuple[str, ...]
    lost: tuple[str, ...]
    max_nodes: int


@dataclasses.dataclass(frozen=True)
class RunView:
    """A watch snapshot: the run's epoch, live member ids and rendezvous state."""

    run_id: str
    epoch: int
    closed: bool
    members: tuple[str, ...]
    round: RoundView
    events: tuple[tuple[str, str, str], ...] = ()  # (type, member id, reason) since the last view


def _run_view(msg: pb.WatchResponse) -> RunView:
    s, r = msg.snapshot, msg.snapshot.round
    return RunView(
        run_id=s.run_id,
        epoch=s.epoch,
        closed=s.closed,
        members=tuple(m.member_id for m in s.members),
        round=RoundView(r.round, tuple(r.participants), tuple(r.waiting), tuple(r.lost), r.config.max_nodes),
        events=tuple(
            (pb.EventType.Name(e.type).removeprefix("EVENT_TYPE_").lower(), e.member.member_id, e.reason)
            for e in msg.events
        ),
    )


class CoordinatorClient:
    """Blocking client. Thread-safe (gRPC channels are); one per process is plenty."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        call_timeout_s: float = 10.0,
        reconnect_timeout_s: float = 30.0,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
    ):
        self.address = address
        self.call_timeout_s = call_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        self.max_message_bytes = max_message_bytes
        self._metadata = wire.auth_metadata(resolve_token(token))
        self._channel = wire.open_channel(address, tls_ca, aio=False, max_message_bytes=max_message_bytes)
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- transport ---------------------------------------------------------------------------

    def _call(self, method: str, request, *, timeout_s: float | None = None, retry_s: float | None = None, stub=None):
        """One unary call (of ``stub``, default the Coordinator service) with a deadline,
        retried on UNAVAILABLE for at most ``retry_s`` counted from its first failure (a long
        poll that the restart of the coordinator breaks, a store wait of 20 s, still gets the
        whole budget to reconnect)."""
        fn = getattr(stub or self._stub, method)
        deadline = self.call_timeout_s if timeout_s is None else timeout_s
        budget = self.reconnect_timeout_s if retry_s is None else retry_s
        wire.stamp_request_id(request)

        def once():
            return fn(request, timeout=deadline, metadata=self._metadata)

        try:
            return once()
        except grpc.RpcError as err:
            if budget <= 0 or not codes.is_retryable(err):
                raise codes.error_from_rpc(err, self.address) from None
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(codes.is_retryable),
            wait=wire.retry_wait(),
            stop=tenacity.stop_after_delay(budget),
            before_sleep=lambda rs: log.debug("coordinator %s unavailable, retrying %s", self.address, method),
            reraise=True,
        )
        try:
            return retrying(once)
        except grpc.RpcError as err:
            raise codes.error_from_rpc(err, self.address) from None

    # -- membership --------------------------------------------------------------------------

    def join(
        self,
        run_id: str,
        member_id: str,
        *,
        host: str | None = None,
        weight: float = 1.0,
        capabilities: dict[str, str] | None = None,
        lease_ttl_s: float = 0.0,
    ) -> JoinResult:
        resp = self._call(
            "Join",
            wire.join_request(
                run_id, member_id, host=host, weight=weight, capabilities=capabilities, lease_ttl_s=lease_ttl_s
            ),
        )
        return JoinResult(run_id, resp.member.member_id, resp.member.incarnation, resp.epoch, resp.lease_ttl_ms / 1000)

    def keep_alive(self, run_id: str, member_id: str, incarnation: int, *, retry_s: float | None = None) -> int:
        ref = wire.member_ref(member_id, incarnation)
        return self._call("KeepAlive", pb.KeepAliveRequest(run_id=run_id, member=ref), retry_s=retry_s).epoch

    def leave(self, run_id: str, member_id: str, incarnation: int, reason: str = "") -> int:
        ref = wire.member_ref(member_id, incarnation)
        return self._call("Leave", pb.LeaveRequest(run_id=run_id, member=ref, reason=reason)).epoch

    def watch(self, run_id: str, *, stop: threading.Event | None = None) -> Iterator[RunView]:
        """Yield a RunView on every change (and a heartbeat every ~15 s), re-subscribing after a
        coordinator restart. Ends when ``stop`` is set (checked between messages) or when the
        coordinator stays unreachable for ``reconnect_timeout_s``."""
        down_since: float | None = None
        while stop is None or not stop.is_set():
            call = self._stub.Watch(pb.WatchRequest(run_id=run_id), metadata=self._metadata)
            try:
                for msg in call:
                    down_since = None
                    yield _run_view(msg)
                    if stop is not None and stop.is_set():
                        call.cancel()
                        return
            except grpc.RpcError as err:
                if not codes.is_retryable(err):
                    if err.code() == grpc.StatusCode.CANCELLED and stop is not None and stop.is_set():
                        return
                    raise codes.error_from_rpc(err, self.address) from None
            now = time.monotonic()
            down_since = down_since or now
            if now - down_since > self.reconnect_timeout_s:
                raise CoordinatorUnavailableError(
                    f"coordinator at {self.address} is unreachable: watch lost for {now - down_since:.1f}s"
                )
            time.sleep(0.2)

    # -- barriers ----------------------------------------------------------------------------

    def arrive(
        self,
        run_id: str,
        member_id: str,
        incarnation: int,
        name: str,
        *,
        timeout_s: float,
        policy: str = "evict_missing",
        epoch: int = 0,
        check: Callable[[], None] | None = None,
        send: Callable[[pb.ArriveRequest, float], pb.ArriveResponse] | None = None,
    ) -> BarrierResult:
        """Arrive at barrier ``name`` and return once it is decided.

        Raises ``BarrierTimeoutError`` (with ``.missing``) when the REPORT policy timed out, and
        ``CoordinatorTimeoutError`` if no decision came well after ``timeout_s``. ``check``, if
        given, runs every ``CHECKED_WAIT_CHUNK_S`` while the barrier is undecided; what it raises
        ends the wait (the arrival stays recorded). ``send(request, timeout_s)``, if given, carries
        each wait's request instead of a unary ``Arrive`` call (``Membership``: its Session stream).
        """
        give_up = time.monotonic() + timeout_s + DEADLINE_SLACK_S + self.reconnect_timeout_s
        chunk = MAX_WAIT_CHUNK_S if check is None else CHECKED_WAIT_CHUNK_S
        while True:
            if check is not None:
                check()
            wait_s = max(0.05, min(chunk, give_up - time.monotonic()))
            request = wire.arrive_request(
                run_id, member_id, incarnation, name, timeout_s=timeout_s, policy=policy, epoch=epoch, wait_s=wait_s
            )
            if send is None:
                response = self._call("Arrive", request, timeout_s=wait_s + DEADLINE_SLACK_S)
            else:
                response = send(request, wait_s + DEADLINE_SLACK_S)
            result = wire.arrive_outcome(name, response)
            if result is not None:
                return result
            if time.monotonic() >= give_up:
                raise CoordinatorTimeoutError(f"barrier {name!r} was not decided within {timeout_s:.3f}s")

    # -- key-value ---------------------------------------------------------------------------

    # ``writer`` (member id, incarnation) on a write fences it: refused once that incarnation is
    # not live. Leave it None where the caller is not a member.

    def kv_set(self, run_id: str, pairs: dict[bytes, bytes] | list[tuple[bytes, bytes]], *, writer: tuple[str, int] | None = None) -> None:
        self._call("KVSet", wire.kv_set_request(run_id, pairs, writer))

    def kv_get(self, run_id: str, keys: list[bytes]) -> list[bytes | None]:
        """Current values; None for a missing key. Never waits."""
        return wire.kv_values(keys, self._call("KVGet", pb.KVGetRequest(run_id=run_id, keys=keys)))

    def kv_wait(self, run_id: str, keys: list[bytes], timeout_s: float) -> list[bytes]:
        """Block until every key exists and return the values; ``CoordinatorTimeoutError`` after
        ``timeout_s``. A coordinator that restarts meanwhile is asked again with the time left
        (re-sent as it was, the request would wait its whole chunk again there), for as long as
        the reconnect budget allows: ``CoordinatorUnavailableError`` past it, or at ``timeout_s``
        if the coordinator is still down then."""
        plan = wire.KVWait(run_id, keys, timeout_s, self.reconnect_timeout_s, MAX_WAIT_CHUNK_S)
        while True:
            request, wait_s = plan.request()
            try:
                return list(self._call("KVGet", request, timeout_s=wait_s + DEADLINE_SLACK_S, retry_s=0).values)
            except CoordinatorTimeoutError as exc:
                plan.timed_out(exc)
            except CoordinatorUnavailableError as exc:
                time.sleep(plan.unavailable(exc))

    def kv_compare_set(
        self, run_id: str, key: bytes, expected: bytes, desired: bytes, *, writer: tuple[str, int] | None = None,
    ) -> tuple[bytes, bool]:
        request = pb.KVCompareSetRequest(run_id=run_id, key=key, expected=expected, desired=desired, **wire.writer_ref(writer))
        resp = self._call("KVCompareSet", request)
        return resp.value, resp.swapped

    def kv_add(self, run_id: str, key: bytes, delta: int, *, writer: tuple[str, int] | None = None) -> int:
        return self._call("KVAdd", pb.KVAddRequest(run_id=run_id, key=key, delta=delta, **wire.writer_ref(writer))).value

    def kv_delete(self, run_id: str, key: bytes, *, writer: tuple[str, int] | None = None) -> bool:
        return self._call("KVDelete", pb.KVDeleteRequest(run_id=run_id, key=key, **wire.writer_ref(writer))).deleted

    def kv_num_keys(self, run_id: str) -> int:
        return self._call("KVNumKeys", pb.KVNumKeysRequest(run_id=run_id)).count

    # -- rendezvous and runs -----------------------------------------------------------------

    def round_join(
        self,
        run_id: str,
        member_id: str,
        incarnation: int,
        *,
        min_nodes: int,
        max_nodes: int,
        last_call_s: float,
        join_timeout_s: float,
        after_round: int,
        rejoin_timeout_s: float = DEFAULT_REJOIN_TIMEOUT_S,
        wait_s: float = MAX_WAIT_CHUNK_S,
    ) -> RoundResult:
        """One bounded wait for a round newer than ``after_round``; status "waiting" means call again."""
        resp = self._call(
            "RoundJoin",
            pb.RoundJoinRequest(
                run_id=run_id,
                member=wire.member_ref(member_id, incarnation),
                config=pb.RoundConfig(
                    min_nodes=min_nodes,
                    max_nodes=max_nodes,
                    last_call_ms=max(1, int(last_call_s * 1000)),
                    join_timeout_ms=max(1, int(join_timeout_s * 1000)),
                    rejoin_timeout_ms=wire.rejoin_timeout_ms(rejoin_timeout_s),
                ),
                after_round=after_round,
                wait_ms=max(1, int(wait_s * 1000)),
            ),
            timeout_s=wait_s + DEADLINE_SLACK_S,
        )
        return RoundResult(_ROUND_STATUS.get(resp.status, "waiting"), resp.round, resp.rank, tuple(resp.participants), resp.reason,
                           resp.standby)

    def close_run(self, run_id: str, reason: str = "") -> None:
        self._call("CloseRun", pb.CloseRunRequest(run_id=run_id, reason=reason))

    def status(self, run_id: str = "", *, include_departed: bool = False) -> dict:
        """The coordinator's view as plain JSON-able data (see ``elasticrl status --json``)."""
        from google.protobuf import json_format

        resp = self._call("Status", pb.StatusRequest(run_id=run_id, include_departed=include_departed))
        return json_format.MessageToDict(
            resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )


def _node_relay(address: str) -> str:
    """The node's session relay for a member of the coordinator at ``address``, "" if none."""
    path = os.environ.get(RELAY_ENV, "")
    return path if os.environ.get(RELAY_FOR_ENV, address) == address else ""  # it serves another coordinator


class Membership:
    """A joined member that renews its lease from a daemon thread, over a Session stream (so its
    death is noticed within the stream grace), until it leaves or is fenced. Its barrier arrivals
    ride that stream too, or go as unary calls while it is down (``member_stream.MemberStream``).

    ``relay``: the socket of this node's session relay (``session_relay.py``) to stream through; None
    takes ``$ELASTICRL_SESSION_RELAY`` (set by a torchrun agent that runs one) unless
    ``$ELASTICRL_SESSION_RELAY_FOR`` names another coordinator; "" streams to the coordinator directly.

    If the coordinator says this incarnation is fenced (it was evicted while paused, say), the
    thread stops, ``fenced`` holds the error, ``on_fenced`` is called once, and every later call
    through this object raises that error: a fenced process must not act as a member again.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        run_id: str,
        member_id: str,
        *,
        on_fenced: Callable[[FencedError], None] | None = None,
        relay: str | None = None,
        **join_kwargs,
    ):
        self.client = client
        self.run_id = run_id
        joined = client.join(run_id, member_id, **join_kwargs)
        self.member_id = joined.member_id
        self.incarnation = joined.incarnation
        self.epoch = joined.epoch
        self.lease_ttl_s = joined.lease_ttl_s
        self.fenced: FencedError | None = None
        self._on_fenced = on_fenced
        self._stop = threading.Event()
        self.streaming = threading.Event()
        """Set once a keep-alive went through the Session stream: from then on the coordinator notices
        this process's death within its stream grace (before, only its lease would)."""
        self._stream = MemberStream(client, run_id, self.member_id, self.incarnation, period_s=self.lease_ttl_s / 3,
                                    stop=self._stop, on_epoch=self._saw_epoch,
                                    relay=_node_relay(client.address) if relay is None else relay)
        self._thread = threading.Thread(target=self._renew, name=f"elasticrl-lease-{member_id}", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        # While this process lives the stream stays open, so when it dies the kernel closes the
        # socket and the coordinator evicts the member within its stream grace (--stream-grace)
        # instead of a lease TTL later.
        try:
            self._stream.run()
        except FencedError as exc:
            self._fence(exc)
        except Exception:  # noqa: BLE001 - a bug here must not pass silently: the lease would lapse
            log.exception("member %s: keep-alive thread failed; the lease will lapse", self.member_id)

    def _saw_epoch(self, epoch: int) -> None:
        self.epoch = max(self.epoch, epoch)
        self.streaming.set()

    def _fence(self, exc: FencedError) -> None:
        self._stop.set()  # a fenced incarnation renews nothing more
        if self.fenced is None:
            self.fenced = exc
            log.error("member %s incarnation %d fenced: %s", self.member_id, self.incarnation, exc)
            if self._on_fenced is not None:
                self._on_fenced(exc)

    def _check(self) -> None:
        if self.fenced is not None:
            raise self.fenced

    def arrive(self, name: str, *, timeout_s: float, policy: str = "evict_missing",
               check: Callable[[], None] | None = None) -> BarrierResult:
        self._check()
        try:
            result = self.client.arrive(
                self.run_id, self.member_id, self.incarnation, name, timeout_s=timeout_s, policy=policy, epoch=self.epoch,
                check=check, send=self._send_arrival,
            )
        except FencedError as exc:
            self._fence(exc)
            raise
        self.epoch = max(self.epoch, result.epoch)
        return result

    def _send_arrival(self, request: pb.ArriveRequest, timeout_s: float) -> pb.ArriveResponse:
        response = self._stream.arrive(request, timeout_s)
        if response is None:  # no stream up, or it broke meanwhile: a unary call (arrivals count once)
            return self.client._call("Arrive", request, timeout_s=timeout_s)
        if response.HasField("error"):
            raise codes.error_from_session(response.error, self.client.address)
        return response.arrive

    def stop(self) -> None:
        """Stop renewing without leaving (the lease then lapses on its own)."""
        self._stop.set()
        self._stream.wake()
        if self._thread is not threading.current_thread():
            # The coordinator ends the stream once it answered the arrivals waiting on it; one of
            # this member's may wait for a barrier the others have not reached: do not wait for it.
            self._thread.join(timeout=CLOSE_WAIT_S)
            if self._thread.is_alive():
                self._stream.cancel()
                self._thread.join(timeout=self.client.call_timeout_s + 1)

    def leave(self, reason: str = "") -> None:
        self.stop()
        if self.fenced is None:
            try:
                self.client.leave(self.run_id, self.member_id, self.incarnation, reason)
            except FencedError:
                pass

    def __enter__(self) -> "Membership":
        return self

    def __exit__(self, *exc) -> None:
        self.leave("exited")
