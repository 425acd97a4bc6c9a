"""Asyncio client of the coordinator, for processes that drive many members from one event loop.

It mirrors the blocking ``client.CoordinatorClient`` for the calls a member makes (join,
keep-alive, leave, barrier arrival, KV set/get/add) and shares its wire conventions: the same
channel options, a gRPC deadline on every call, retries on UNAVAILABLE with jittered backoff for
at most ``reconnect_timeout_s``, and every other gRPC error mapped once by ``codes.error_from_rpc``.
Barrier arrivals and KV waits are chains of short server-side waits (``wait_ms``), so a
coordinator restart in the middle of one costs one retried, idempotent call. ``session()`` gives a
member the same keep-alive and arrival calls over one long-lived stream (``aio_session``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import tenacity

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl._proto import coordinator_pb2_grpc as pb_grpc
from elasticrl.coordinator import codes, wire
from elasticrl.coordinator.aio_session import AsyncSession
from elasticrl.coordinator.client import JoinResult, resolve_token
from elasticrl.coordinator.state import BarrierResult
from elasticrl.coordinator.wire import DEADLINE_SLACK_S, MAX_WAIT_CHUNK_S
from elasticrl.errors import CoordinatorTimeoutError, CoordinatorUnavailableError

log = logging.getLogger(__name__)


class AsyncCoordinatorClient:
    """Non-blocking client on one ``grpc.aio`` channel. Use it from one event loop only.

    Raises the ``elasticrl.errors`` classes: ``FencedError`` for a stale incarnation,
    ``CoordinatorTimeoutError`` past a deadline, ``CoordinatorUnavailableError`` once the
    coordinator stayed unreachable for ``reconnect_timeout_s``.
    """

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
        self._metadata = wire.auth_metadata(resolve_token(token))
        self._channel = wire.open_channel(address, tls_ca, aio=True, max_message_bytes=max_message_bytes)
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncCoordinatorClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- transport ---------------------------------------------------------------------------

    async def _call(self, method: str, request, *, timeout_s: float | None = None, retry_s: float | None = None, stub=None):
        """One unary call (of ``stub``, default the Coordinator service) with a deadline,
        retried on UNAVAILABLE for at most ``retry_s``."""
        fn = getattr(stub or self._stub, method)
        deadline = self.call_timeout_s if timeout_s is None else timeout_s
        wire.stamp_request_id(request)
        try:
            # The first attempt bypasses tenacity: building its retry state costs ~30 us a call,
            # which is most of a barrier's per-member client cost when one process hosts many.
            return await fn(request, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as err:
            if not codes.is_retryable(err) or (retry_s is not None and retry_s <= 0):
                raise codes.error_from_rpc(err, self.address) from None
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(codes.is_retryable),
            wait=wire.retry_wait(),
            stop=tenacity.stop_after_delay(self.reconnect_timeout_s if retry_s is None else retry_s),
            before_sleep=lambda rs: log.debug("coordinator %s unavailable, retrying %s", self.address, method),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await fn(request, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as err:
            raise codes.error_from_rpc(err, self.address) from None

    # -- membership --------------------------------------------------------------------------

    async def join(
        self,
        run_id: str,
        member_id: str,
        *,
        host: str | None = None,
        weight: float = 1.0,
        capabilities: dict[str, str] | None = None,
        lease_ttl_s: float = 0.0,
    ) -> JoinResult:
        resp = await self._call(
            "Join",
            wire.join_request(
                run_id, member_id, host=host, weight=weight, capabilities=capabilities, lease_ttl_s=lease_ttl_s
            ),
        )
        return JoinResult(run_id, resp.member.member_id, resp.member.incarnation, resp.epoch, resp.lease_ttl_ms / 1000)

    async def keep_alive(self, run_id: str, member_id: str, incarnation: int, *, retry_s: float | None = None) -> int:
        ref = wire.member_ref(member_id, incarnation)
        resp = await self._call("KeepAlive", pb.KeepAliveRequest(run_id=run_id, member=ref), retry_s=retry_s)
        return resp.epoch

    async def leave(self, run_id: str, member_id: str, incarnation: int, reason: str = "") -> int:
        ref = wire.member_ref(member_id, incarnation)
        return (await self._call("Leave", pb.LeaveRequest(run_id=run_id, member=ref, reason=reason))).epoch

    # -- barriers ----------------------------------------------------------------------------

    async def arrive(
        self,
        run_id: str,
        member_id: str,
        incarnation: int,
        name: str,
        *,
        timeout_s: float,
        policy: str = "evict_missing",
        epoch: int = 0,
    ) -> BarrierResult:
        """Arrive at barrier ``name`` and return once it is decided (same contract as the sync client).

        Raises ``BarrierTimeoutError`` (with ``.missing``) when the REPORT policy timed out, and
        ``CoordinatorTimeoutError`` if no decision came well after ``timeout_s``.
        """
        give_up = time.monotonic() + timeout_s + DEADLINE_SLACK_S + self.reconnect_timeout_s
        while True:
            wait_s = max(0.05, min(MAX_WAIT_CHUNK_S, give_up - time.monotonic()))
            request = wire.arrive_request(
                run_id, member_id, incarnation, name, timeout_s=timeout_s, policy=policy, epoch=epoch, wait_s=wait_s
            )
            result = wire.arrive_outcome(name, await self._call("Arrive", request, timeout_s=wait_s + DEADLINE_SLACK_S))
            if result is not None:
                return result
            if time.monotonic() >= give_up:
                raise CoordinatorTimeoutError(f"barrier {name!r} was not decided within {timeout_s:.3f}s")

    # -- sessions ----------------------------------------------------------------------------

    def session(self, run_id: str, member_id: str, incarnation: int) -> AsyncSession:
        """A Session stream for one joined member: ``keep_alive()`` and ``arrive()`` as messages on
        one open stream, far cheaper for the coordinator than a unary call each (see ``aio_session``)."""
        return AsyncSession(
            self._stub, run_id, member_id, incarnation, address=self.address, metadata=self._metadata,
            call_timeout_s=self.call_timeout_s, reconnect_timeout_s=self.reconnect_timeout_s,
        )

    # -- key-value ---------------------------------------------------------------------------

    async def kv_set(self, run_id: str, pairs: dict[bytes, bytes] | list[tuple[bytes, bytes]]) -> None:
        await self._call("KVSet", wire.kv_set_request(run_id, pairs))

    async def kv_get(self, run_id: str, keys: list[bytes]) -> list[bytes | None]:
        """Current values; None for a missing key. Never waits."""
        return wire.kv_values(keys, await self._call("KVGet", pb.KVGetRequest(run_id=run_id, keys=keys)))

    async def kv_wait(self, run_id: str, keys: list[bytes], timeout_s: float) -> list[bytes]:
        """Block until every key exists and return the values; ``CoordinatorTimeoutError`` after
        ``timeout_s`` (a coordinator restart meanwhile: as ``CoordinatorClient.kv_wait``)."""
        plan = wire.KVWait(run_id, keys, timeout_s, self.reconnect_timeout_s, MAX_WAIT_CHUNK_S)
        while True:
            request, wait_s = plan.request()
            try:
                return list((await self._call("KVGet", request, timeout_s=wait_s + DEADLINE_SLACK_S, retry_s=0)).values)
            except CoordinatorTimeoutError as exc:
                plan.timed_out(exc)
            except CoordinatorUnavailableError as exc:
                await asyncio.sleep(plan.unavailable(exc))

    async def kv_add(self, run_id: str, key: bytes, delta: int) -> int:
        return (await self._call("KVAdd", pb.KVAddRequest(run_id=run_id, key=key, delta=delta))).value
