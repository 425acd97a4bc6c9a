"""The raw-gRPC baseline of ``bench/coordinator.py``: the floor of a barrier whose members each
hold one grpc.aio stream, as the coordinator's ``session`` transport does, with nothing else.

    python bench/barrier_rawgrpc.py serve --port-file FILE     # the server (the coordinator's place)

One generic handler (``grpc.method_handlers_generic_handler``, identity (de)serializers, so every
message is the bytes sent), in a process of its own with the coordinator's server options:

* ``Session`` (stream-stream): each request is ``b"<world> <name>"``; the handler counts the
  arrival at barrier ``name`` and, once ``world`` members have arrived, every member's handler
  writes ``b"released <name>"`` on its own stream. One coroutine per stream reads and writes with
  ``context.read()`` / ``context.write()``: no reader task, no queue, no protobuf, no leases, no
  validation, no state beyond a count and a future per open barrier.
* ``Count`` (unary): the request is a barrier's name, the response how many members have arrived
  there (ASCII digits), for the bench's ``last`` pattern.

What the coordinator adds on top of this floor (per member: a protobuf parse and checks, the
lease and epoch checks, the barrier's bookkeeping, SQLite when durable, a response listing every
member) is what its session row's ``x_rawgrpc`` measures.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

SERVICE = "elasticrl.bench.RawBarrier"
SESSION = f"/{SERVICE}/Session"
COUNT = f"/{SERVICE}/Count"


class Barriers:
    """Open barriers by name: [members arrived, the future their release is]."""

    def __init__(self):
        self.open: dict[bytes, list] = {}

    async def session(self, requests, context) -> None:
        del requests  # read with context.read(): one coroutine per stream, as cheap as grpc.aio goes
        loop = asyncio.get_running_loop()
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            world, name = msg.split(b" ", 1)
            barrier = self.open.get(name)
            if barrier is None:
                barrier = self.open[name] = [0, loop.create_future()]
            barrier[0] += 1
            if barrier[0] >= int(world):
                del self.open[name]
                barrier[1].set_result(b"released " + name)
            await context.write(await barrier[1])

    async def count(self, name: bytes, context) -> bytes:
        del context
        barrier = self.open.get(name)
        return str(0 if barrier is None else barrier[0]).encode()


async def serve(port_file: str) -> None:
    from bench.scheduler_raw import serve_handler

    barriers = Barriers()
    await serve_handler(grpc.method_handlers_generic_handler(SERVICE, {
        "Session": grpc.stream_stream_rpc_method_handler(barriers.session),
        "Count": grpc.unary_unary_rpc_method_handler(barriers.count),
    }), port_file)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/barrier_rawgrpc.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the barrier server until SIGTERM")
    s.add_argument("--port-file", required=True, help="write the bound port here once serving")
    args = p.parse_args(argv)
    asyncio.run(serve(args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
