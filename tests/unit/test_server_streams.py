"""A server stream whose client goes away mid-write ends quietly (``service._parsing``).

A real grpc.aio server runs the coordinator's server-stream wrapper; its client cancels calls at
random moments while large messages are being written. gRPC must log nothing at ERROR: before the
fix about a third of such calls logged ``ExecuteBatchError ... TOO_MANY_OPERATIONS`` with a
traceback (the handler returned after its first write failed, so gRPC sent the initial metadata a
second time), which is what a coordinator serving weights to killed workers printed.
"""

from __future__ import annotations

import asyncio
import logging
import random

import grpc
import pytest
from google.protobuf import wrappers_pb2

from elasticrl.coordinator.service import _parsing

BIG = b"x" * (8 << 20)  # past HTTP/2 flow control, so writes are still in flight when the cancel comes


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


async def _cancel_mid_stream(kind: str, calls: int, rng: random.Random) -> tuple[int, int]:
    started = closed = 0

    async def impl(requests, context):
        nonlocal started, closed
        started += 1
        try:
            if kind == "bidi":  # its first request (none when the client went away before sending it)
                async for _ in requests:
                    break
            for _ in range(3):
                yield wrappers_pb2.BytesValue(value=BIG)
        finally:
            closed += 1

    method = grpc.stream_stream_rpc_method_handler if kind == "bidi" else grpc.unary_stream_rpc_method_handler
    handler = method(_parsing(impl, wrappers_pb2.BytesValue, kind), response_serializer=lambda m: m.SerializeToString())
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Stream", {"Big": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
            method = channel.stream_stream if kind == "bidi" else channel.unary_stream
            big = method("/t.Stream/Big", request_serializer=lambda m: m.SerializeToString(), response_deserializer=len)
            for _ in range(calls):
                call = big(iter([wrappers_pb2.BytesValue(value=b"go")]) if kind == "bidi" else wrappers_pb2.BytesValue(value=b"go"))
                await asyncio.sleep(rng.uniform(0, 0.01))
                call.cancel()
        await asyncio.sleep(0.5)  # the last calls' handlers see the close
    finally:
        await server.stop(2)
    return started, closed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["server_stream", "bidi"])
def test_a_client_that_goes_away_mid_write_leaves_no_error_in_the_log(kind):
    records = _Records()
    grpc_log = logging.getLogger("grpc")
    level = grpc_log.level
    grpc_log.addHandler(records)
    grpc_log.setLevel(logging.DEBUG)
    try:
        started, closed = asyncio.run(asyncio.wait_for(_cancel_mid_stream(kind, 150, random.Random(7)), 45))
    finally:
        grpc_log.removeHandler(records)
        grpc_log.setLevel(level)
    errors = [f"{r.getMessage()} {r.exc_info[1] if r.exc_info else ''}" for r in records.records if r.levelno >= logging.ERROR]
    assert not errors, f"{len(errors)} of 150 cancelled streams logged an error, e.g. {errors[0]}"
    assert started > 0 and closed == started, f"{closed} of the {started} streams started closed their generator"


def test_a_unary_reply_that_could_not_be_sent_is_one_info_line_and_other_errors_stay():
    # What gRPC logs when a handler returned but its client had gone before gRPC heard of the
    # close (test_weights_random seed 2 under load: a PublishWeights reply to a torn connection).
    from grpc._cython.cygrpc import ExecuteBatchError

    from elasticrl.coordinator.service import quiet_unsent_replies

    records = _Records()
    core_log = logging.getLogger("grpc._cython.cygrpc")
    core_log.addHandler(records)
    quiet_unsent_replies()
    quiet_unsent_replies()  # once only
    try:
        try:
            raise ExecuteBatchError('Failed "execute_batch"')
        except ExecuteBatchError:
            core_log.exception("ExecuteBatchError raised in core by servicer method [%s]", "/elasticrl.v1.Scheduler/PublishWeights")
        core_log.error("something else went wrong")
    finally:
        core_log.removeHandler(records)
    sent, other = records.records
    assert (sent.levelname, sent.exc_info) == ("INFO", None) and "\n" not in sent.getMessage()
    assert "PublishWeights]: the reply was not sent, the client had gone" in sent.getMessage()
    assert other.levelname == "ERROR" and sum(type(f).__name__ == "_UnsentReply" for f in core_log.filters) == 1
