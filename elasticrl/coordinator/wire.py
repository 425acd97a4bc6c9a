"""What the sync and async clients share: channels, retry timing, request builders, response decoders.

The two clients differ only in how they wait (threads vs an event loop); everything that decides
what goes on the wire and how an answer is read lives here once.
"""

from __future__ import annotations

import uuid

import asyncio
import os
import socket
import time
import types

import grpc
import tenacity

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl.config.base import check_address
from elasticrl.coordinator.state import BarrierResult, Outcome
from elasticrl.errors import BarrierTimeoutError

# Matches the coordinator's default --max-message-mb; trajectory batches are the large messages.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 0),
    # Reconnect quickly after a coordinator restart instead of gRPC's default 1-120 s backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# The longest single server-side wait; longer waits are repeated calls.
MAX_WAIT_CHUNK_S = 20.0
# Slack between a server-side wait and the call's gRPC deadline.
DEADLINE_SLACK_S = 5.0
# How long a member closing its Session stream lets the coordinator end it after the ``close``
# message (it answers the arrivals still waiting on it first), before cancelling it.
CLOSE_WAIT_S = 0.5

POLICIES = {"evict_missing": pb.TIMEOUT_POLICY_EVICT_MISSING, "report": pb.TIMEOUT_POLICY_REPORT}


def open_channel(address: str, tls_ca: str | None, *, aio: bool, max_message_bytes: int = MAX_MESSAGE_BYTES):
    """A (grpc or grpc.aio) channel to ``address``: TLS verified against ``tls_ca`` when given."""
    check_address(address)
    mod = grpc.aio if aio else grpc
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ] + CHANNEL_OPTIONS
    if tls_ca is None:
        return mod.insecure_channel(address, options=options)
    try:
        with open(tls_ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    except OSError as exc:
        raise ValueError(f"tls_ca: cannot read {tls_ca!r}: {exc.strerror or exc}") from None
    return mod.secure_channel(address, creds, options=options)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def retry_wait():
    """Backoff between reconnect attempts: exponential from 50 ms to 1 s, plus up to 50 ms jitter."""
    return tenacity.wait_exponential(multiplier=0.05, max=1.0) + tenacity.wait_random(0, 0.05)


class ReopenBudget:
    """How a long-lived stream (a member's Session, an engine's Work stream) is reopened after it
    breaks: backoff pauses (``retry_wait``) until it has stayed down for ``budget_s``. Any stream
    that got up starts the budget afresh."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self._down_since: float | None = None  # first failure since the last stream that was up
        self._failures = 0

    def pause_after(self, was_up: bool) -> float | None:
        """Seconds to wait before the next attempt, or None once the budget is spent."""
        now = time.monotonic()
        if was_up or self._down_since is None:
            self._down_since, self._failures = now, 0
        left = self._down_since + self.budget_s - now
        if left <= 0:
            return None
        self._failures += 1
        return min(retry_wait()(types.SimpleNamespace(attempt_number=self._failures)), left)


def read_token_file(path: str | os.PathLike) -> str:
    """The shared token in a token file: its first line, stripped ("" if there is none). The
    coordinator, the agents, the workers and the CLI all read it so (a file may end in a comment
    or a second token for a later rotation). Raises OSError."""
    with open(path, encoding="utf-8") as f:
        return f.readline().strip()


async def stream_requests(outbox: asyncio.Queue):
    """The request iterator of one stream: what is put in ``outbox`` until a None ends it."""
    while (request := await outbox.get()) is not None:
        yield request


def rejoin_timeout_ms(seconds: float) -> int:
    """``RoundConfig.rejoin_timeout_ms`` for ``seconds``: 0 (do not hold) goes as -1, because 0 on
    the wire means the default."""
    return max(1, int(seconds * 1000)) if seconds > 0 else -1


def join_request(run_id, member_id, *, host, weight, capabilities, lease_ttl_s) -> pb.JoinRequest:
    return pb.JoinRequest(
        run_id=run_id,
        member_id=member_id,
        host=socket.gethostname() if host is None else host,
        weight=weight,
        capabilities=capabilities or {},
        lease_ttl_ms=int(lease_ttl_s * 1000),
    )


def member_ref(member_id: str, incarnation: int) -> pb.MemberRef:
    return pb.MemberRef(member_id=member_id, incarnation=incarnation)


def arrive_request(run_id, member_id, incarnation, name, *, timeout_s, policy, epoch, wait_s) -> pb.ArriveRequest:
    if policy not in POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of {sorted(POLICIES)}")
    return pb.ArriveRequest(
        run_id=run_id,
        member=member_ref(member_id, incarnation),
        name=name,
        epoch=epoch,
        timeout_ms=max(1, int(timeout_s * 1000)),
        policy=POLICIES[policy],
        wait_ms=max(1, int(wait_s * 1000)),
    )


def arrive_outcome(name: str, resp: pb.ArriveResponse) -> BarrierResult | None:
    """The decided result, None while pending; ``BarrierTimeoutError`` for a REPORT timeout."""
    if resp.outcome == pb.BARRIER_OUTCOME_COMPLETED:
        return BarrierResult(
            Outcome.COMPLETED, list(resp.arrived), list(resp.evicted), list(resp.missing), resp.epoch, resp.reason
        )
    if resp.outcome == pb.BARRIER_OUTCOME_TIMED_OUT:
        raise BarrierTimeoutError(
            f"barrier {name!r}: {resp.reason}", name=name, missing=list(resp.missing), arrived=list(resp.arrived)
        )
    return None


_HAS_REQUEST_ID: dict[type, bool] = {}


def stamp_request_id(request) -> None:
    """Give a request that has a ``request_id`` field a fresh idempotency key, unless it has one:
    a call stamps its request once, and every retry re-sends the same message, so the coordinator
    answers a retry of an applied call with the stored result instead of applying it again."""
    kind = type(request)
    has = _HAS_REQUEST_ID.get(kind)
    if has is None:
        has = _HAS_REQUEST_ID[kind] = "request_id" in kind.DESCRIPTOR.fields_by_name
    if has and not request.request_id:
        request.request_id = uuid.uuid4().hex


def writer_ref(writer: tuple[str, int] | None) -> dict:
    """Keyword arguments that set a write's optional ``member`` fence."""
    return {} if writer is None else {"member": member_ref(*writer)}


def kv_set_request(run_id: str, pairs, writer: tuple[str, int] | None = None) -> pb.KVSetRequest:
    items = pairs.items() if isinstance(pairs, dict) else pairs
    return pb.KVSetRequest(run_id=run_id, pairs=[pb.KVPair(key=k, value=v) for k, v in items], **writer_ref(writer))


class KVWait:
    """The plan of a client's ``kv_wait`` (sync and asyncio alike): ``request`` asks for the next
    chunk of at most ``MAX_WAIT_CHUNK_S``; after a chunk that timed out, ``timed_out`` raises once
    ``timeout_s`` is spent; after an unreachable coordinator, ``unavailable`` gives the pause
    before asking again (with the time left: re-sent as it was, the request would wait its whole
    chunk again), or raises past the reconnect budget or at ``timeout_s``."""

    def __init__(self, run_id: str, keys: list[bytes], timeout_s: float, reconnect_timeout_s: float, max_chunk_s: float):
        self.run_id, self.keys, self.max_chunk_s = run_id, keys, max_chunk_s
        self.give_up = time.monotonic() + timeout_s
        self._outage, self._answered = ReopenBudget(reconnect_timeout_s), True

    def request(self) -> tuple[pb.KVGetRequest, float]:
        """The next request and how long the coordinator may hold it (s)."""
        wait_s = max(0.001, min(self.max_chunk_s, self.give_up - time.monotonic()))
        return pb.KVGetRequest(run_id=self.run_id, keys=self.keys, wait_ms=max(1, int(wait_s * 1000))), wait_s

    def timed_out(self, exc: Exception) -> None:
        if time.monotonic() >= self.give_up:
            raise exc
        self._answered = True

    def unavailable(self, exc: Exception) -> float:
        pause, self._answered = self._outage.pause_after(self._answered), False
        left = self.give_up - time.monotonic()
        if pause is None or left <= 0:
            raise exc
        return min(pause, left)  # at the deadline one last try: a timeout if it answers


def kv_values(keys: list[bytes], resp: pb.KVGetResponse) -> list[bytes | None]:
    missing = set(resp.missing)
    return [None if k in missing else val for k, val in zip(keys, resp.values)]
