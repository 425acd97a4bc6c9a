"""A Session stream's client that does not read its responses, against a real coordinator
subprocess: the coordinator stops reading that stream (backpressure) instead of queueing
responses without limit, and a client that reads again gets every answer in order. Arrivals
waiting at once on one stream are capped too; the one past the cap fails alone."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl._proto import coordinator_pb2_grpc as pb_grpc
from elasticrl.coordinator import wire
from elasticrl.coordinator.aio_client import AsyncCoordinatorClient
from elasticrl.coordinator.session import SESSION_MAX_ARRIVALS, SESSION_MAX_PENDING

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.waits]

PAD_BYTES = 8 << 10
# Past SESSION_MAX_PENDING, gRPC itself buffers a few MiB of a stream's requests (its flow-control
# window, grown by BDP probing): about 700 of these padded requests on grpcio 1.85, so the writes
# stop after ~1,700. Without backpressure the coordinator reads every request, however many.
MAX_WRITES = 20_000


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _padded(request: pb.SessionRequest) -> pb.SessionRequest:
    """``request`` with PAD_BYTES in an unknown field (number 1000, length-delimited), which the
    coordinator parses and ignores: big requests fill gRPC's buffers in a few messages."""
    pad = _varint(1000 << 3 | 2) + _varint(PAD_BYTES) + bytes(PAD_BYTES)
    return pb.SessionRequest.FromString(request.SerializeToString() + pad)


def _channel(address: str) -> grpc.aio.Channel:
    # No BDP probing and a small per-stream window on this side: the client's own gRPC does not
    # read ahead the responses this test leaves unread.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    return grpc.aio.insecure_channel(address, options=options)


def test_a_client_that_does_not_read_is_pushed_back_and_then_answered_in_order(coordinator):
    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5) as client:
            joined = await client.join("run-bp", "m0", lease_ttl_s=120)
        keep_alive = pb.SessionRequest(keep_alive=pb.KeepAliveRequest(
            run_id="run-bp", member=wire.member_ref("m0", joined.incarnation)))
        async with _channel(coordinator.address) as channel:
            call = pb_grpc.CoordinatorStub(channel).Session()
            await asyncio.wait_for(call.initial_metadata(), 10)
            request = _padded(keep_alive)
            assert request.ByteSize() > PAD_BYTES
            sent, write = 0, None
            while sent < MAX_WRITES:
                request.id = sent + 1
                write = asyncio.ensure_future(call.write(request))
                done, _ = await asyncio.wait({write}, timeout=2.0)
                if not done:
                    break  # the coordinator stopped reading this stream
                write.result()
                sent += 1
            assert sent < MAX_WRITES, f"{sent} requests read from a client that reads no responses"
            assert sent >= SESSION_MAX_PENDING  # the bound is on what waits, not a smaller one
            # Reading again: every keep-alive is answered, in order, and the blocked write goes on.
            started = time.monotonic()
            for expect in range(1, sent + 2):
                response = await asyncio.wait_for(call.read(), 10)
                assert response.id == expect and response.WhichOneof("result") == "keep_alive", response
            await asyncio.wait_for(write, 10)
            assert time.monotonic() - started < 30
            request.id = sent + 2  # the stream goes on
            await call.write(request)
            assert (await asyncio.wait_for(call.read(), 10)).id == sent + 2
            call.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 100))


def test_arrivals_past_the_limit_fail_alone_with_resource_exhausted(coordinator):
    async def scenario():
        async with AsyncCoordinatorClient(coordinator.address, call_timeout_s=5) as client:
            a = await client.join("run-arr", "a", lease_ttl_s=120)
            await client.join("run-arr", "b", lease_ttl_s=120)  # never arrives: a's arrivals wait
        member = wire.member_ref("a", a.incarnation)
        async with _channel(coordinator.address) as channel:
            call = pb_grpc.CoordinatorStub(channel).Session()
            await asyncio.wait_for(call.initial_metadata(), 10)
            arrive = wire.arrive_request("run-arr", "a", a.incarnation, "b1", timeout_s=60, policy="evict_missing",
                                         epoch=0, wait_s=30)
            for i in range(SESSION_MAX_ARRIVALS + 1):
                await call.write(pb.SessionRequest(id=i + 1, arrive=arrive))
            response = await asyncio.wait_for(call.read(), 10)
            assert response.id == SESSION_MAX_ARRIVALS + 1 and response.WhichOneof("result") == "error", response
            assert response.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert f"limit {SESSION_MAX_ARRIVALS}" in response.error.message
            # keep-alives are still answered while the arrivals wait
            keep_alive = pb.KeepAliveRequest(run_id="run-arr", member=member)
            await call.write(pb.SessionRequest(id=10**6, keep_alive=keep_alive))
            response = await asyncio.wait_for(call.read(), 10)
            assert response.id == 10**6 and response.WhichOneof("result") == "keep_alive", response
            call.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 60))
