"""A bench worker process: drives a share of the members of one barrier, for ``bench/coordinator.py``.

One process plays many members (asyncio tasks, or threads for TCPStore, whose calls block), so
hundreds of members fit a small machine. The driver talks to it with one JSON object per line:
commands on stdin, replies on stdout, each reply naming its ``op``. Commands:

* ``{"op": "setup", "impl": ..., "members": [...], "ranks": [...], "world": N, ...}``: join the
  coordinator (and start one keep-alive loop per member; with ``"transport": "session"`` each
  member also opens its Session stream, with ``"batched"`` all members of the process share one
  stream, whose operations go in batch messages; with ``"membership"`` each member is a
  ``client.Membership``, as a trainer worker's), open a raw gRPC stream per member (``"rawgrpc"``),
  connect TCPStore clients, or prepare the flag directory. Replied once every member is ready.
* ``{"op": "round", "name": B, "hold": R}``: every member of this process arrives at barrier
  ``B`` at once, except rank ``R`` (if it lives here), which waits for ``go``. The round runs in
  the background (so ``go`` can be read meanwhile) and is replied once all are released, with
  ``"times": [[sent, released], ...]``, ``"evicted": [...]`` and ``"cpu_s"`` (CPU seconds this
  process spent in the round). Times are ``time.monotonic()`` (CLOCK_MONOTONIC, comparable
  across processes on one host): ``sent`` just before a member issued its arrival, ``released``
  just after its barrier call returned.
* ``{"op": "go"}``: the held member arrives now; replied at once.
* ``{"op": "teardown"}``: stop keep-alives and close connections (no Leave: the driver discards
  the whole coordinator or store afterwards).

Every reply carries ``"ok"``; a failure replies ``{"ok": false, "op": ..., "error": "..."}`` and
the driver stops the bench.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import sys
import time
import traceback


JOINS_IN_FLIGHT = 64
# Members per shared Session stream with transport "batched": the coordinator lets one stream have
# at most SESSION_MAX_ARRIVALS (1024) arrivals waiting, so a process with more opens more streams.
MEMBERS_PER_STREAM = 1024


def _released(cfg: dict, name: str, done: list) -> dict:
    """A round's reply from its members' (sent, released, BarrierResult), each result checked:
    every live member must be counted (the failure scenario also reports the evicted one)."""
    for _, _, result in done:
        expected = cfg["world"] - len(result.evicted)
        assert len(result.arrived) == expected, f"barrier {name}: {len(result.arrived)} arrived, expected {expected}"
    return {"times": [[s, r] for s, r, _ in done], "evicted": sorted(done[0][2].evicted) if done else []}


async def _in_thread(pool, gate: asyncio.Event | None, arrive, *args):
    """``arrive(*args)`` (a blocking member's arrival) in ``pool``, once ``gate`` (if any) is set."""
    if gate is not None:
        await gate.wait()
    return await asyncio.get_running_loop().run_in_executor(pool, arrive, *args)


class CoordinatorMembers:
    """Members that join the elasticrl coordinator, keep their leases and arrive at leased barriers.

    ``transport`` "unary": one Arrive / KeepAlive call per operation; "session": each member
    opens one Session stream after joining and sends both as messages on it; "batched": one
    Session stream for the whole process (``AsyncSession.member``), operations queued together
    going as one batch message.
    """

    def __init__(self, cfg: dict):
        from elasticrl.coordinator.aio_client import AsyncCoordinatorClient

        self.cfg = cfg
        self.run_id = cfg["run_id"]
        n_channels = 1 if cfg.get("shared_channel") else len(cfg["members"])
        self.clients = [AsyncCoordinatorClient(cfg["address"], call_timeout_s=30, reconnect_timeout_s=10) for _ in range(n_channels)]
        self.refs: list[tuple[str, int]] = []
        self.sessions: list = []  # per member: its AsyncSession ("session") or SessionMember ("batched")
        self.shared: dict[int, object] = {}  # with transport "batched": the process's AsyncSession(s)
        self.keepalives: list[asyncio.Task] = []

    def _client(self, i: int):
        return self.clients[i % len(self.clients)]

    async def setup(self) -> None:
        # Each member joins, opens its session and starts renewing at once: with thousands of
        # members, joining them all first leaves the early ones' leases to lapse before the last
        # one has joined (a 4096-member storm takes longer than a 5 s TTL on 2 cores).
        members = self.cfg["members"]
        self.refs = [("", 0)] * len(members)
        session = self.cfg.get("transport", "unary") in ("session", "batched")
        self.sessions = [None] * len(members) if session else []
        self.keepalives = [None] * len(members)
        # At most JOINS_IN_FLIGHT members of this process between their join and their session's
        # first keep-alive: each real member is its own process, whose keep-alive follows its join
        # at once; a thousand joins queued in one event loop would leave the first ones' replies
        # unread past their lease (the coordinator still sees every worker process join at once).
        gate = asyncio.Semaphore(JOINS_IN_FLIGHT)
        await asyncio.gather(*(self._join(i, m, gate) for i, m in enumerate(members)))

    async def _join(self, i: int, member: str, gate: asyncio.Semaphore) -> None:
        async with gate:
            await self._join_one(i, member)

    async def _join_one(self, i: int, member: str) -> None:
        client = self._client(i)
        j = await client.join(self.run_id, member, host="bench", lease_ttl_s=self.cfg["lease_ttl_s"])
        self.refs[i] = (j.member_id, j.incarnation)
        if self.cfg.get("transport") == "batched":
            shared = self.shared.get(i // MEMBERS_PER_STREAM)
            if shared is None:
                shared = self.shared[i // MEMBERS_PER_STREAM] = client.session(self.run_id, j.member_id, j.incarnation)
            self.sessions[i] = shared.member(j.member_id, j.incarnation)
            await self.sessions[i].keep_alive()  # the first opens the stream; each attaches its member
        elif self.sessions:
            self.sessions[i] = client.session(self.run_id, j.member_id, j.incarnation)
            await self.sessions[i].keep_alive()  # opens the stream
        self.keepalives[i] = asyncio.create_task(self._keep_alive(i))

    async def _keep_alive(self, i: int) -> None:
        # Same period as client.Membership (a third of the TTL), phases spread so renewals do not
        # arrive as one burst.
        period = self.cfg["lease_ttl_s"] / 3
        await asyncio.sleep(random.uniform(0, period))
        mid, inc = self.refs[i]
        while True:
            if self.sessions:
                await self.sessions[i].keep_alive()
            else:
                await self._client(i).keep_alive(self.run_id, mid, inc, retry_s=period)
            await asyncio.sleep(period)

    async def _arrive(self, i: int, name: str, gate: asyncio.Event | None):
        if gate is not None:
            await gate.wait()
        mid, inc = self.refs[i]
        sent = time.monotonic()
        if self.sessions:
            result = await self.sessions[i].arrive(name, timeout_s=self.cfg["barrier_timeout_s"])
        else:
            result = await self._client(i).arrive(self.run_id, mid, inc, name, timeout_s=self.cfg["barrier_timeout_s"])
        released = time.monotonic()
        return sent, released, result

    async def round(self, name: str, gates: dict[int, asyncio.Event]) -> dict:
        ranks = self.cfg["ranks"]
        done = await asyncio.gather(*(self._arrive(i, name, gates.get(ranks[i])) for i in range(len(self.refs))))
        return _released(self.cfg, name, done)

    async def teardown(self) -> None:
        tasks = [t for t in self.keepalives if t is not None]  # None: setup failed before it
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.shared:
            await asyncio.gather(*(session.close() for session in self.shared.values()))
        else:
            await asyncio.gather(*(session.close() for session in self.sessions if session is not None))
        for client in self.clients:
            await client.close()


class MembershipMembers:
    """Transport "membership": the trainer's own member class, ``client.Membership`` (blocking
    calls, a renewal thread and one Session stream per member, its arrivals on that stream), a
    thread per member and a channel per member, as each trainer worker process has."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.members: list = []
        self.relays: list = []
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    async def setup(self) -> None:
        from elasticrl.coordinator.client import CoordinatorClient, Membership

        names = self.cfg["members"]
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(names), thread_name_prefix="member")
        gate = concurrent.futures.ThreadPoolExecutor(max_workers=JOINS_IN_FLIGHT)  # as CoordinatorMembers: bounded joins
        paths = [None] * len(names)
        if self.cfg.get("transport") == "relay":  # a node relay per relay_members members, as per node
            from elasticrl.coordinator.session_relay import RelayThread

            fanin = self.cfg["relay_members"]
            self.relays = [RelayThread(self.cfg["address"]) for _ in range(0, len(names), fanin)]
            paths = [self.relays[i // fanin].path for i in range(len(names))]

        def join(name: str, relay: str | None):
            client = CoordinatorClient(self.cfg["address"], call_timeout_s=30, reconnect_timeout_s=10)
            m = Membership(client, self.cfg["run_id"], name, host="bench", lease_ttl_s=self.cfg["lease_ttl_s"], relay=relay)
            if not m.streaming.wait(30):
                raise TimeoutError(f"member {name}: its Session stream did not open within 30s")
            return m

        try:
            self.members = list(await asyncio.gather(*(
                asyncio.get_running_loop().run_in_executor(gate, join, n, path) for n, path in zip(names, paths))))
        finally:
            gate.shutdown(wait=False)

    def _arrive(self, m, name: str):
        sent = time.monotonic()
        result = m.arrive(name, timeout_s=self.cfg["barrier_timeout_s"])
        return sent, time.monotonic(), result

    async def round(self, name: str, gates: dict[int, asyncio.Event]) -> dict:
        ranks = self.cfg["ranks"]
        done = await asyncio.gather(*(_in_thread(self.pool, gates.get(ranks[i]), self._arrive, m, name) for i, m in enumerate(self.members)))
        return _released(self.cfg, name, done)

    async def teardown(self) -> None:
        for m in self.members:
            m.stop()
            m.client.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        for relay in self.relays:
            relay.stop()
        self.members, self.relays = [], []


class RawGrpcMembers:
    """The raw-gRPC floor (``bench/barrier_rawgrpc.py``): each member holds one grpc.aio stream,
    as with transport "session", sends ``b"<world> <name>"`` and reads its release; no join, no
    lease, no protobuf. Channels as ``CoordinatorMembers``'s: one per member unless shared."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.channels: list = []
        self.calls: list = []

    async def setup(self) -> None:
        from bench.barrier_rawgrpc import SESSION
        from elasticrl.coordinator import wire

        n = len(self.cfg["members"])
        self.channels = [wire.open_channel(self.cfg["address"], None, aio=True) for _ in range(1 if self.cfg.get("shared_channel") else n)]
        self.calls = [
            self.channels[i % len(self.channels)].stream_stream(SESSION, request_serializer=None, response_deserializer=None)()
            for i in range(n)
        ]
        # opened now, as a member's Session stream is opened when it joins
        await asyncio.wait_for(asyncio.gather(*(call.wait_for_connection() for call in self.calls)), 120)

    async def _arrive(self, call, name: str, gate: asyncio.Event | None) -> tuple[float, float]:
        if gate is not None:
            await gate.wait()
        sent = time.monotonic()
        await call.write(f"{self.cfg['world']} {name}".encode())
        released = await call.read()
        assert released == b"released " + name.encode(), f"barrier {name}: answered {released!r}"
        return sent, time.monotonic()

    async def round(self, name: str, gates: dict[int, asyncio.Event]) -> dict:
        ranks = self.cfg["ranks"]
        done = await asyncio.gather(*(self._arrive(c, name, gates.get(ranks[i])) for i, c in enumerate(self.calls)))
        return {"times": [list(t) for t in done], "evicted": []}

    async def teardown(self) -> None:
        for call in self.calls:
            call.cancel()
        for channel in self.channels:
            await channel.close()
        self.calls, self.channels = [], []


class TCPStoreMembers:
    """The baseline on torch's TCPStore: ``torch.distributed.elastic.utils.store.barrier`` per member.

    TCPStore calls block (they release the GIL), so each member is a thread with its own client.
    """

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.stores: list = []
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    async def setup(self) -> None:
        import datetime

        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.cfg["barrier_timeout_s"])
        host, port = self.cfg["address"].rsplit(":", 1)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.cfg["members"]), thread_name_prefix="member")
        # Connected in parallel: a connect can stall on a slow reverse DNS lookup (see the driver).
        connect = lambda _: TCPStore(host, int(port), is_master=False, timeout=timeout)  # noqa: E731
        self.stores = list(self.pool.map(connect, self.cfg["members"]))

    def _arrive(self, store, name: str) -> tuple[float, float]:
        from torch.distributed.elastic.utils.store import barrier

        sent = time.monotonic()
        barrier(store, self.cfg["world"], key_prefix=name, barrier_timeout=self.cfg["barrier_timeout_s"])
        return sent, time.monotonic()

    async def round(self, name: str, gates: dict[int, asyncio.Event]) -> dict:
        ranks = self.cfg["ranks"]
        done = await asyncio.gather(*(_in_thread(self.pool, gates.get(ranks[i]), self._arrive, s, name) for i, s in enumerate(self.stores)))
        return {"times": [list(t) for t in done], "evicted": []}

    async def teardown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.stores = []


class FlagFileMembers:
    """The shared-filesystem baseline: each member writes ``<name>_rank_<r>`` into one directory,
    then lists the directory every ``poll_s`` until all ``world`` flags of ``name`` are there."""

    def __init__(self, cfg: dict):
        self.cfg = cfg

    async def setup(self) -> None:
        os.makedirs(self.cfg["flag_dir"], exist_ok=True)

    async def _arrive(self, rank: int, name: str, gate: asyncio.Event | None) -> tuple[float, float]:
        if gate is not None:
            await gate.wait()
        flag_dir, world, prefix = self.cfg["flag_dir"], self.cfg["world"], f"{name}_rank_"
        sent = time.monotonic()
        with open(os.path.join(flag_dir, f"{prefix}{rank}"), "w") as f:
            f.write("1")
        while sum(1 for entry in os.listdir(flag_dir) if entry.startswith(prefix)) < world:
            await asyncio.sleep(self.cfg["poll_s"])
        return sent, time.monotonic()

    async def round(self, name: str, gates: dict[int, asyncio.Event]) -> dict:
        done = await asyncio.gather(*(self._arrive(r, name, gates.get(r)) for r in self.cfg["ranks"]))
        return {"times": [list(t) for t in done], "evicted": []}

    async def teardown(self) -> None:
        pass


IMPLS = {"coordinator": CoordinatorMembers, "rawgrpc": RawGrpcMembers, "tcpstore": TCPStoreMembers, "flagfile": FlagFileMembers}


def _reply(msg: dict) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def _failed(op: str, exc: BaseException) -> dict:
    traceback.print_exc()
    return {"ok": False, "op": op, "error": f"{type(exc).__name__}: {exc}"}


async def _run_round(members, name: str, gates: dict[int, asyncio.Event]) -> None:
    try:
        cpu = time.process_time()  # this process, all threads: the members' client-side cost
        result = await members.round(name, gates)
        _reply({"ok": True, "op": "round", "cpu_s": time.process_time() - cpu, **result})
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which fails the bench
        _reply(_failed("round", exc))


async def serve() -> None:
    loop = asyncio.get_running_loop()
    members = None
    round_task: asyncio.Task | None = None
    gates: dict[int, asyncio.Event] = {}
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break  # the driver went away
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "setup":
                impl = MembershipMembers if cmd.get("transport") in ("membership", "relay") else IMPLS[cmd["impl"]]
                members = impl(cmd)
                await members.setup()
            elif op == "round":
                assert members is not None, "round before setup"
                assert round_task is None or round_task.done(), "round while another round runs"
                hold = cmd.get("hold")
                gates = {hold: asyncio.Event()} if hold is not None else {}
                round_task = asyncio.create_task(_run_round(members, cmd["name"], gates))
                continue  # replied by the round task once every member here is released
            elif op == "go":
                for gate in gates.values():
                    gate.set()
            elif op == "teardown":
                if round_task is not None:
                    round_task.cancel()
                if members is not None:
                    await members.teardown()
                members = None
            else:
                raise ValueError(f"op: unknown command {op!r}")
            reply = {"ok": True, "op": op}
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which fails the bench
            reply = _failed(op, exc)
        _reply(reply)
    if members is not None:
        await members.teardown()


def main() -> int:
    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
