"""Asyncio client of the coordinator, for processes that drive many members from one event loop.

It mirrors the blocking ``client.CoordinatorClient`` for the calls a member makes (join,
keep-alive, leave, barrier arrival, KV set/get/add) and shares its wire conventions: the same
channel options, a gRPC deadline on every call, retries on UNAVAILABLE with jittered backoff for
at most ``reconnect_timeout_s``, and every other gRPC error mapped once by ``codes.error_from_rpc``.
Barrier arrivals and KV waits are chains of short server-side waits (``wait_ms``), so a
coordinator restart in the middle of one costs one retried, idempotent call.
"""

from __future__ import annotations

import logging
import socket
import time

import grpc
import tenacity

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl._proto import coordinator_pb2_grpc as pb_grpc
from elasticrl.coordinator import codes
from elasticrl.coordinator.client import (
    _POLICY,
    CHANNEL_OPTIONS,
    DEADLINE_SLACK_S,
    MAX_WAIT_CHUNK_S,
    JoinResult,
    resolve_token,
)
from elasticrl.coordinator.state import BarrierResult, Outcome
from elasticrl.errors import BarrierTimeoutError, CoordinatorTimeoutError

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
    ):
        if ":" not in address:
            raise ValueError(f"address: {address!r} must be HOST:PORT")
        self.address = address
        self.call_timeout_s = call_timeout_s
        self.reconnect_timeout_s = reconnect_timeout_s
        token = resolve_token(token)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        if tls_ca is not None:
            with open(tls_ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self._channel = grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncCoordinatorClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- transport ---------------------------------------------------------------------------

    async def _call(self, method: str, request, *, timeout_s: float | None = None, retry_s: float | None = None):
        """One unary call with a deadline, retried on UNAVAILABLE for at most ``retry_s``."""
        fn = getattr(self._stub, method)
        deadline = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            # The first attempt bypasses tenacity: building its retry state costs ~30 us a call,
            # which is most of a barrier's per-member client cost when one process hosts many.
            return await fn(request, timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as err:
            if not codes.is_retryable(err):
                raise codes.error_from_rpc(err, self.address) from None
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(codes.is_retryable),
            wait=tenacity.wait_exponential_jitter(multiplier=0.05, max=1.0),
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
            pb.JoinRequest(
                run_id=run_id,
                member_id=member_id,
                host=socket.gethostname() if host is None else host,
                weight=weight,
                capabilities=capabilities or {},
                lease_ttl_ms=int(lease_ttl_s * 1000),
            ),
        )
        return JoinResult(run_id, resp.member.member_id, resp.member.incarnation, resp.epoch, resp.lease_ttl_ms / 1000)

    async def keep_alive(self, run_id: str, member_id: str, incarnation: int, *, retry_s: float | None = None) -> int:
        ref = pb.MemberRef(member_id=member_id, incarnation=incarnation)
        resp = await self._call("KeepAlive", pb.KeepAliveRequest(run_id=run_id, member=ref), retry_s=retry_s)
        return resp.epoch

    async def leave(self, run_id: str, member_id: str, incarnation: int, reason: str = "") -> int:
        ref = pb.MemberRef(member_id=member_id, incarnation=incarnation)
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
        if policy not in _POLICY:
            raise ValueError(f"policy: {policy!r} is not one of {sorted(_POLICY)}")
        give_up = time.monotonic() + timeout_s + DEADLINE_SLACK_S + self.reconnect_timeout_s
        ref = pb.MemberRef(member_id=member_id, incarnation=incarnation)
        while True:
            wait_s = max(0.05, min(MAX_WAIT_CHUNK_S, give_up - time.monotonic()))
            resp = await self._call(
                "Arrive",
                pb.ArriveRequest(
                    run_id=run_id,
                    member=ref,
                    name=name,
                    epoch=epoch,
                    timeout_ms=max(1, int(timeout_s * 1000)),
                    policy=_POLICY[policy],
                    wait_ms=max(1, int(wait_s * 1000)),
                ),
                timeout_s=wait_s + DEADLINE_SLACK_S,
            )
            if resp.outcome == pb.BARRIER_OUTCOME_COMPLETED:
                return BarrierResult(
                    Outcome.COMPLETED, list(resp.arrived), list(resp.evicted), list(resp.missing), resp.epoch, resp.reason
                )
            if resp.outcome == pb.BARRIER_OUTCOME_TIMED_OUT:
                raise BarrierTimeoutError(
                    f"barrier {name!r}: {resp.reason}", name=name, missing=list(resp.missing), arrived=list(resp.arrived)
                )
            if time.monotonic() >= give_up:
                raise CoordinatorTimeoutError(f"barrier {name!r} was not decided within {timeout_s:.3f}s")

    # -- key-value ---------------------------------------------------------------------------

    async def kv_set(self, run_id: str, pairs: dict[bytes, bytes] | list[tuple[bytes, bytes]]) -> None:
        items = pairs.items() if isinstance(pairs, dict) else pairs
        await self._call("KVSet", pb.KVSetRequest(run_id=run_id, pairs=[pb.KVPair(key=k, value=v) for k, v in items]))

    async def kv_get(self, run_id: str, keys: list[bytes]) -> list[bytes | None]:
        """Current values; None for a missing key. Never waits."""
        resp = await self._call("KVGet", pb.KVGetRequest(run_id=run_id, keys=keys))
        missing = set(resp.missing)
        return [None if k in missing else val for k, val in zip(keys, resp.values)]

    async def kv_wait(self, run_id: str, keys: list[bytes], timeout_s: float) -> list[bytes]:
        """Block until every key exists and return the values; ``CoordinatorTimeoutError`` after ``timeout_s``."""
        give_up = time.monotonic() + timeout_s
        while True:
            wait_s = max(0.001, min(MAX_WAIT_CHUNK_S, give_up - time.monotonic()))
            try:
                resp = await self._call(
                    "KVGet",
                    pb.KVGetRequest(run_id=run_id, keys=keys, wait_ms=max(1, int(wait_s * 1000))),
                    timeout_s=wait_s + DEADLINE_SLACK_S,
                )
                return list(resp.values)
            except CoordinatorTimeoutError:
                if time.monotonic() >= give_up:
                    raise

    async def kv_add(self, run_id: str, key: bytes, delta: int) -> int:
        return (await self._call("KVAdd", pb.KVAddRequest(run_id=run_id, key=key, delta=delta))).value
