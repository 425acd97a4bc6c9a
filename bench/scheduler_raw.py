"""The raw-gRPC baseline of ``bench/scheduler.py``'s streaming section: the same serialized
messages over one grpc.aio bidi stream, with no protobuf parsing and nothing stored.

    python bench/scheduler_raw.py serve --port-file FILE     # the sink (the coordinator's place)
    python bench/scheduler_raw.py send --address HOST:PORT --groups 400 --samples 8 --tokens 4096 \
        --batch-groups 4 [--rounds 3 | --on-stdin]           # the sender (the worker's place)

The sink is a generic handler (``grpc.method_handlers_generic_handler``) whose (de)serializers
are the identity, so each request arrives as the bytes sent; it answers every message with a
small ack, as the Work stream answers every ResultBatch. The coordinator's Work stream takes its
requests as bytes too (a registered method without a deserializer; it reads result batches in
place), so both receive the same way. Both ends use the coordinator's own server and channel
options (``server_options``, ``wire.open_channel``), so the message size limits are the same,
and the sink's process tunes glibc's allocator as the coordinator's does (``coordinator/malloc.py``).
The sender builds one serialized ``WorkRequest(results=ResultBatch(...))`` exactly as
``RolloutWorker`` does (``framing.result_batch_request``, with a batch id of the same length),
sends a copy of it ``ceil(groups / batch_groups)`` times on one stream without waiting for acks
(the worker waits for nothing either, but its slots bound what it has in flight), and prints one
JSON line per round: first send and last ack (CLOCK_MONOTONIC seconds), bytes.
With ``--on-stdin`` it sends one round per line read from stdin (until EOF), so a driver can
interleave its rounds with other measurements.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import os
import pathlib
import signal
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

METHOD = "/elasticrl.bench.RawSink/Stream"
ACK = b"\x08\x04"  # about the size of a ResultAck with accepted=4


async def serve(port_file: str) -> None:
    async def stream(requests, context):
        async for request in requests:  # bytes: the identity deserializer
            del request
            yield ACK

    await serve_handler(grpc.method_handlers_generic_handler(
        "elasticrl.bench.RawSink", {"Stream": grpc.stream_stream_rpc_method_handler(stream)}
    ), port_file)


async def serve_handler(handler, port_file: str) -> None:
    """Serve ``handler`` on a free local port, as the coordinator's process would (its allocator
    tuning and server options), write the port to ``port_file`` once serving, until SIGTERM/SIGINT."""
    from elasticrl.coordinator import malloc
    from elasticrl.coordinator.server import MAX_MESSAGE_BYTES, server_options

    malloc.tune()  # as the coordinator's process does
    server = grpc.aio.server(options=server_options(MAX_MESSAGE_BYTES))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tmp = f"{port_file}.tmp"
    pathlib.Path(tmp).write_text(f"{port}\n")
    os.replace(tmp, port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def batch_message(groups: int, samples: int, tokens: int) -> tuple[bytes, int]:
    """One serialized ``WorkRequest`` of ``groups`` groups, as ``RolloutWorker`` builds it (batch
    id included), and its sample payload bytes."""
    import uuid

    from elasticrl.scheduler.framing import result_batch_request
    from elasticrl.scheduler.state import GroupRecord, SampleRecord

    ids = array.array("i", range(1000, 1000 + tokens)).tobytes()
    lps = array.array("f", [-0.5] * tokens).tobytes()
    group_samples = [SampleRecord(ids, lps, reward=float(j % 2), finish_reason="length") for j in range(samples)]
    batch = [(1, GroupRecord(f"t{i:06d}", "", 0, 0.0, 0.0, group_samples)) for i in range(groups)]
    return result_batch_request(batch, uuid.uuid4().hex), groups * samples * len(ids + lps)


async def send(args: argparse.Namespace) -> None:
    from elasticrl.coordinator import wire

    full, full_payload = batch_message(args.batch_groups, args.samples, args.tokens)
    # A copy per message, not one object sent n times: a worker sends fresh buffers, not one
    # that stays in the CPU cache.
    messages = [(bytes(bytearray(full)), full_payload) for _ in range(args.groups // args.batch_groups)]
    if args.groups % args.batch_groups:
        messages.append(batch_message(args.groups % args.batch_groups, args.samples, args.tokens))
    channel = wire.open_channel(args.address, None, aio=True)
    call_stream = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)
    try:
        await asyncio.wait_for(channel.channel_ready(), args.timeout_s)
        loop = asyncio.get_running_loop()
        r = 0
        while True:
            if args.on_stdin:
                if not await loop.run_in_executor(None, sys.stdin.readline):
                    break
            elif r >= args.rounds:
                break
            first: list[float] = []

            async def requests():
                for data, _ in messages:
                    if not first:
                        first.append(time.monotonic())
                    yield data

            call = call_stream(requests(), timeout=args.timeout_s)
            acks = 0
            async for _ in call:
                acks += 1
                if acks == len(messages):
                    last = time.monotonic()
            if acks != len(messages):
                raise RuntimeError(f"round {r}: {acks} acks for {len(messages)} messages")
            print(json.dumps({
                "round": r, "first_send": first[0], "last_ack": last, "messages": len(messages),
                "payload_bytes": sum(p for _, p in messages), "wire_bytes": sum(len(d) for d, _ in messages),
            }), flush=True)
            r += 1
    finally:
        await channel.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/scheduler_raw.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the sink until SIGTERM")
    s.add_argument("--port-file", required=True, help="write the bound port here once serving")
    c = sub.add_parser("send", help="stream the messages, one JSON line per round")
    c.add_argument("--address", required=True, metavar="HOST:PORT")
    c.add_argument("--groups", type=int, default=400, help="groups (tasks' results) per round (default: %(default)s)")
    c.add_argument("--samples", type=int, default=8, help="samples per group (default: %(default)s)")
    c.add_argument("--tokens", type=int, default=4096, help="completion tokens per sample (default: %(default)s)")
    c.add_argument("--batch-groups", type=int, default=4, help="groups per message (default: %(default)s)")
    c.add_argument("--rounds", type=int, default=1, help="streams sent one after the other (default: %(default)s)")
    c.add_argument("--on-stdin", action="store_true", help="instead of --rounds: one stream per line read from stdin, until EOF")
    c.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each stream, seconds (default: %(default)s)")
    args = p.parse_args(argv)
    if args.cmd == "serve":
        asyncio.run(serve(args.port_file))
    else:
        asyncio.run(send(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
