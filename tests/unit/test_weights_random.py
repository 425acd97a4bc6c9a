"""Seeded random schedules of policy-weight publishing and distribution against an in-process
coordinator (``CoordinatorServer`` on a loop thread, real gRPC over loopback, restartable on
the same port and state dir).

``test_store_schedule``: ``rollout.weights_transfer=coordinator``. A trainer publishes versions
of random small blobs (odd sizes, chunk boundaries hit exactly, empty ones), retries, stale and
torn/corrupt uploads, abandoned streams, overlapping publishes, too many uploads at once
(``--max-weight-uploads``), coordinator restarts (durable state dir); fetchers ask for the
latest, an older version, the one they hold, one not published yet, and fetch while a publish
replaces the blob. Promises checked (quoted from ``scheduler/weights.py``):
  * "a torn or corrupted upload leaves the previous version served"; a fetch is byte-identical
    to what was published as that version, and "latest" never goes back for a fetcher;
  * "a fetch holding the old one has it open": a publish during a fetch never tears it;
  * "a publish whose version is not above the stored one is refused (FencedError)", "except the
    same version with the same sha256";
  * "an upload over the cap on concurrent ones" is refused (RESOURCE_EXHAUSTED naming the flag),
    and "The temp file of an upload that fails or whose stream goes away is deleted at once".

``test_relay_schedule``: ``rollout.weights_transfer=relay``. A trainer peer publishes versions
(rate-limited, so transfers overlap the schedule); workers join at random, fetch in loops (a chain
forms), and die mid-transfer (their ``WeightPeer`` closes); the coordinator restarts (its
directory is in memory: "the trainer's next announce and every worker's next locate rebuild it").
Promises (``weights/peer.py``): "The returned ``Held`` is complete, verified" (byte-identical to
the published blob), versions only increase per worker, a dead source makes the reader "resume
from another at the same offset" (no worker fails while the trainer holds the version, all reach
the last version in bounded time), and a version the trainer no longer keeps
(``KEEP_VERSIONS``) is refused with a clear error.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import queue
import random
import threading
import time

import grpc
import pytest

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl._proto import scheduler_pb2_grpc as spb_grpc
from elasticrl.coordinator.server import CoordinatorConfig, CoordinatorServer
from elasticrl.errors import FencedError, InvalidRequestError
from elasticrl.scheduler import client as sclient
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.scheduler.weights import UPLOAD_SUFFIX
from elasticrl.weights import peer as P
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(90)

SEEDS = [int(s) for s in os.environ["WEIGHTS_RANDOM_SEEDS"].split(",")] if os.environ.get("WEIGHTS_RANDOM_SEEDS") else list(range(8))
RUN = "wrand"
KiB, MiB = 1 << 10, 1 << 20
FETCH_CHUNK = MiB // 2  # FetchWeights' message size under --max-message-mb 1


def sha(data) -> str:
    return hashlib.sha256(data).hexdigest()


def blob_of(rng: random.Random, size: int) -> bytes:
    """A minimal safetensors file (8-byte length, ``{}`` padded with spaces) of exactly ``size``
    bytes (>= 10), the rest random: the store checks only the header."""
    header_len = rng.randint(2, max(2, min(64, size - 8)))
    header = b"{}" + b" " * (header_len - 2)
    body = rng.randbytes(size - 8 - header_len)
    out = header_len.to_bytes(8, "little") + header + body
    assert len(out) == size
    return out


def random_size(rng: random.Random, chunk: int) -> int:
    kind = rng.random()
    if kind < 0.3:  # chunk boundaries hit exactly, or missed by one
        return max(10, rng.randint(1, 4) * chunk + rng.choice([-1, 0, 0, 1]))
    if kind < 0.45:  # the coordinator's fetch chunks, exactly
        return rng.randint(1, 2) * FETCH_CHUNK + rng.choice([-1, 0, 1])
    if kind < 0.55:
        return rng.randint(10, 20)  # tiny
    return rng.randint(10, 300 * KiB)


class Coordinator:
    """A ``CoordinatorServer`` on its own event loop thread; ``restart`` stops it and serves
    the same state dir on the same port (a durable restart, like ``elasticrl coordinator``)."""

    def __init__(self, tmp: pathlib.Path, *, durable: bool, max_uploads: int = 4):
        self.state_dir = str(tmp / "state") if durable else None
        self.max_uploads = max_uploads
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="coordinator-loop", daemon=True)
        self.thread.start()
        self.server: CoordinatorServer | None = None
        self.start()

    def _run(self, coro, timeout_s: float = 20.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self) -> None:
        config = CoordinatorConfig(host="127.0.0.1", port=self.port, state_dir=self.state_dir, lease_ttl_s=5.0,
                                   max_message_bytes=1 << 20, max_kv_value_bytes=64 << 10, max_weight_uploads=self.max_uploads)

        async def make():
            server = CoordinatorServer(config)
            await server.start()
            return server

        self.server = self._run(make())
        self.port = self.server.port

    def stop(self) -> None:
        if self.server is not None:
            self._run(self.server.stop(0.2))
            self.server = None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def spooled(self) -> list[pathlib.Path]:
        """Upload temp files under the weights directory (the state dir's, or the private temp dir)."""
        return sorted(self.server.weights.directory.rglob(f"*{UPLOAD_SUFFIX}"))

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


class OpenUpload:
    """A PublishWeights stream fed chunk by chunk (as in test_weights_uploads); ``end`` closes the
    stream normally, ``cancel`` tears it."""

    def __init__(self, stub, version: int, data: bytes, *, digest: str | None = None, total: int | None = None):
        self.version, self.data, self.sent = version, data, 0
        self.digest = digest or sha(data)
        self.total = len(data) if total is None else total
        self._chunks: queue.Queue = queue.Queue()
        self.future = stub.PublishWeights.future(iter(self._chunks.get, None), timeout=30)

    def send(self, n: int) -> None:
        piece = self.data[self.sent:self.sent + n]
        self._chunks.put(spb.WeightChunk(run_id=RUN, version=self.version, total_bytes=self.total, offset=self.sent,
                                         data=piece, sha256=self.digest, format="safetensors"))
        self.sent += len(piece)

    def end(self):
        self._chunks.put(None)
        return self.future

    def cancel(self) -> None:
        self.future.cancel()
        self._chunks.put(None)


def rpc_error(future, timeout_s: float = 20.0) -> grpc.RpcError | None:
    try:
        future.result(timeout=timeout_s)
        return None
    except grpc.FutureCancelledError as err:
        return err
    except grpc.RpcError as err:
        return err


# -- coordinator mode: WeightStore behind PublishWeights / FetchWeights ---------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_store_schedule(seed, tmp_path):
    rng = random.Random(seed)
    durable = seed % 4 != 3
    max_uploads = rng.randint(1, 3)
    coord = Coordinator(tmp_path, durable=durable, max_uploads=max_uploads)
    published: dict[int, bytes] = {}
    latest = 0  # the stored version (0: none yet)
    fetchers = {f"f{i}": -1 for i in range(3)}  # what each fetcher holds
    trace: list[str] = []
    client = SchedulerClient(coord.address, call_timeout_s=10, reconnect_timeout_s=20)
    channel = grpc.insecure_channel(coord.address)
    stub = spb_grpc.SchedulerStub(channel)

    def note(msg: str) -> None:
        trace.append(msg)

    def check_fetch(name: str, result, *, expect_version: int | None) -> None:
        have = fetchers[name]
        if expect_version is None:
            assert result is None, (name, have, result and result[0], trace)
            return
        assert result is not None, (name, have, expect_version, trace)
        version, data = result
        assert version == expect_version, (name, version, expect_version, trace)
        assert version > have, f"{name}: latest went back from {have} to {version}: {trace}"
        assert sha(data) == sha(published[version]) and data == published[version], (name, version, trace)
        fetchers[name] = version

    def publish_new(version: int) -> bytes:
        chunk = rng.choice([1000, 4096, 64 * KiB, 256 * KiB])
        data = blob_of(rng, random_size(rng, chunk))
        published[version] = data
        client.publish_weights(RUN, version, data, chunk_bytes=chunk)
        return data

    try:
        assert client.fetch_weights(RUN) is None  # nothing yet: an empty answer
        for step in range(14):
            op = rng.choices(
                ["publish", "fetch", "retry", "stale", "bad", "abandon", "overlap", "limit", "fetch_during", "wait",
                 "restart"],
                weights=[4, 4, 1, 1, 1.5, 1, 1, 1, 1, 1, 1 if durable else 0],
            )[0]
            if latest == 0 and op in ("retry", "stale", "fetch_during"):
                op = "publish"
            note(f"{step}:{op}")
            if op == "publish":
                latest += rng.randint(1, 3)  # versions need not be consecutive
                publish_new(latest)
            elif op == "fetch":
                name = rng.choice(list(fetchers))
                kind = rng.choice(["latest", "older", "held", "future"])
                have = {"latest": fetchers[name], "older": max(-1, latest - rng.randint(1, 3)),
                        "held": latest, "future": latest + rng.randint(1, 5)}[kind]
                have = max(have, fetchers[name]) if kind != "older" else have
                note(f"  {name} {kind} have={have}")
                result = client.fetch_weights(RUN, have_version=have, wait_s=0.0)
                if have >= latest or latest == 0:
                    assert result is None, (name, kind, have, trace)
                else:
                    # "older": a fresh process on an older version gets the newest, never the old one
                    assert result is not None and result[0] == latest and result[1] == published[latest], (kind, trace)
                    if result[0] > fetchers[name]:
                        check_fetch(name, result, expect_version=latest)
            elif op == "retry":  # the same version and bytes again: idempotent
                client.publish_weights(RUN, latest, published[latest], chunk_bytes=rng.choice([7, 4096, 512 * KiB]))
            elif op == "stale":
                if rng.random() < 0.5 and latest > 1:
                    with pytest.raises(FencedError, match=rf"version {latest - 1} is older than the stored version {latest}"):
                        client.publish_weights(RUN, latest - 1, blob_of(rng, 100))
                else:
                    with pytest.raises(FencedError, match=rf"version {latest} is already stored"):
                        client.publish_weights(RUN, latest, blob_of(rng, 100))
            elif op == "bad":
                version = latest + 1
                data = blob_of(rng, random_size(rng, 4096))
                how = rng.choice(["empty", "torn", "flip", "not-safetensors"])
                note(f"  {how} {len(data)}")
                if how == "empty":
                    with pytest.raises(InvalidRequestError, match="total_bytes: 0 must be >= 1"):
                        client.publish_weights(RUN, version, b"")
                elif how == "not-safetensors":
                    with pytest.raises(InvalidRequestError, match="safetensors"):
                        client.publish_weights(RUN, version, b"\xff" * 8 + data[8:])
                else:
                    up = OpenUpload(stub, version, data)
                    if how == "flip":
                        flipped = bytearray(data)
                        flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                        up.data = bytes(flipped)
                        while up.sent < len(data):
                            up.send(rng.randint(1, max(1, len(data) // 3)))
                    else:
                        up.send(rng.randint(0, len(data) - 1))
                    err = rpc_error(up.end())
                    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, (how, err, trace)
                    want = "sha256: the" if how == "flip" else "total_bytes: the stream ended after"
                    assert want in err.details(), (err.details(), trace)
            elif op == "abandon":
                data = blob_of(rng, random_size(rng, 4096))
                up = OpenUpload(stub, latest + 1, data)
                up.send(rng.randint(1, len(data) - 1))
                if rng.random() < 0.5:
                    wait_until(lambda: coord.spooled(), 10, message="the upload spooling")
                up.cancel()
                assert rpc_error(up.future) is not None
                wait_until(lambda: not coord.spooled() and coord.server.weights.uploads_in_progress == 0, 10,
                           message=f"the abandoned upload's temp file going: {trace}")
            elif op == "overlap":  # two publishes of newer versions at once, finishing in a random order
                first, second = latest + 1, latest + rng.randint(2, 3)
                if max_uploads < 2:
                    # the second is refused while the first holds the only slot
                    a = OpenUpload(stub, first, blob_of(rng, random_size(rng, 4096)))
                    a.send(1)
                    wait_until(lambda: coord.server.weights.uploads_in_progress == 1, 10, message="the first upload")
                    b = OpenUpload(stub, second, blob_of(rng, 100))
                    b.send(100)
                    err = rpc_error(b.end())
                    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err, trace)
                    assert "--max-weight-uploads 1" in err.details()
                    while a.sent < len(a.data):
                        a.send(rng.randint(1, 64 * KiB))
                    assert rpc_error(a.end()) is None
                    published[first] = a.data
                    latest = first
                else:
                    ups = [OpenUpload(stub, v, blob_of(rng, random_size(rng, 4096))) for v in (first, second)]
                    while any(u.sent < len(u.data) for u in ups):
                        u = rng.choice([u for u in ups if u.sent < len(u.data)])
                        u.send(rng.randint(1, 64 * KiB))
                    order = rng.sample(ups, 2)
                    for u in order:
                        err = rpc_error(u.end())
                        if u.version < latest:  # the newer one committed first: this one is fenced
                            assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, (err, trace)
                            assert f"version {u.version} is older than the stored version {latest}" in err.details()
                        else:
                            assert err is None, (err and err.details(), trace)
                            published[u.version] = u.data
                            latest = u.version
                    note(f"  order {[u.version for u in order]} -> {latest}")
            elif op == "limit":
                ups = [OpenUpload(stub, latest + 1 + i, blob_of(rng, 5000)) for i in range(max_uploads)]
                for u in ups:
                    u.send(rng.randint(1, 4000))
                wait_until(lambda: len(coord.spooled()) == max_uploads, 10, message="every slot taken")
                extra = OpenUpload(stub, latest + 10, blob_of(rng, 50))
                extra.send(50)
                err = rpc_error(extra.end())
                assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err, trace)
                assert f"{max_uploads} weight uploads are already in progress" in err.details()
                assert f"--max-weight-uploads {max_uploads}" in err.details()
                assert len(coord.spooled()) == max_uploads  # the refused one took nothing
                for u in ups:
                    u.cancel()
                wait_until(lambda: not coord.spooled() and coord.server.weights.uploads_in_progress == 0, 10,
                           message=f"the cancelled uploads' temp files going: {trace}")
            elif op == "fetch_during":  # a publish lands while a fetch streams the old blob
                old = latest
                stream = stub.FetchWeights(spb.FetchWeightsRequest(run_id=RUN, have_version=-1, wait_s=0), timeout=30)
                head = next(stream)
                latest += 1
                publish_new(latest)
                got = sclient._assemble(RUN, iter([head, *stream]))
                assert got is not None and got[0] == old and got[1] == published[old], (old, trace)
                assert client.fetch_weights(RUN) == (latest, published[latest])
            elif op == "wait":  # a fetch waiting for the next version gets it, whole, once published
                name = rng.choice(list(fetchers))
                have = max(fetchers[name], latest)
                fetchers[name] = have
                box: list = []
                th = threading.Thread(target=lambda: box.append(client.fetch_weights(RUN, have_version=have, wait_s=10)),
                                      daemon=True)
                th.start()
                time.sleep(rng.uniform(0, 0.1))
                latest = have + 1 if have >= latest else latest + 1
                publish_new(latest)
                th.join(15)
                assert not th.is_alive() and box, f"the waiting fetch hung: {trace}"
                check_fetch(name, box[0], expect_version=latest)
            elif op == "restart":
                coord.restart()
                assert not coord.spooled()
            # After every step: the newest version is served whole, and nothing is left spooling.
            if latest:
                assert client.fetch_weights(RUN) == (latest, published[latest]), trace
            assert coord.server.weights.uploads_in_progress == 0 or op == "abandon", trace
        wait_until(lambda: not coord.spooled() and coord.server.weights.uploads_in_progress == 0, 10,
                   message=f"no upload left: {trace}")
        if durable and latest:
            run_dir = pathlib.Path(coord.state_dir) / "weights" / RUN
            assert sorted(p.name for p in run_dir.iterdir()) == ["current.json", f"v{latest:020d}.safetensors"], trace
    finally:
        channel.close()
        client.close()
        coord.close()


# -- relay mode: peers serve each other, the coordinator only names sources ------------------------------------------


class Worker:
    """A rollout worker's relay side: a ``WeightPeer`` and a thread fetching newer versions in a loop."""

    def __init__(self, name: str, address: str, got: list, errors: list):
        self.name = name
        self.peer = P.WeightPeer(stall_timeout_s=1.0)
        self.client = SchedulerClient(address, call_timeout_s=5, reconnect_timeout_s=15)
        self.stop = threading.Event()
        self.dead = False
        self.have = -1
        self.got, self.errors = got, errors
        self.thread = threading.Thread(target=self._loop, name=f"worker-{name}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                held = P.fetch(self.client, RUN, self.name, self.peer, have_version=self.have, wait_s=0.3, token=None,
                               stop=self.stop, stall_timeout_s=0.5, resume_timeout_s=8.0)
            except Exception as exc:  # noqa: BLE001 - the test reads it
                self.errors.append((self.name, self.dead, repr(exc)))
                if self.dead:
                    return
                time.sleep(0.05)
                continue
            if held is None:
                continue
            # Hash while this worker still serves it: what the fetch returned as complete.
            self.got.append((self.name, self.dead, self.have, held.version, held.complete, sha(held.view()),
                             held.total_bytes, list(held.sources)))
            self.have = held.version

    def kill(self) -> None:
        """The process dies: its server goes away (readers behind it break) and it fetches no more."""
        self.dead = True
        self.stop.set()
        self.peer.close()

    def receiving(self) -> bool:
        held = self.peer.newest()
        return held is not None and not held.complete and held.filled > 0

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)
        self.peer.close()
        self.client.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_relay_schedule(seed, tmp_path, monkeypatch):
    rng = random.Random(1000 + seed)
    monkeypatch.setattr(P, "REANNOUNCE_S", 0.3)  # a worker re-announces what it holds soon after a restart
    coord = Coordinator(tmp_path, durable=False)
    trainer_client = SchedulerClient(coord.address, call_timeout_s=5, reconnect_timeout_s=15)
    trainer = P.WeightPeer(rate_limit_bytes_s=8 * MiB, stall_timeout_s=0.3)
    published: dict[int, str] = {}  # version -> sha256 of the blob
    sizes: dict[int, int] = {}
    got: list = []
    errors: list = []
    workers: list[Worker] = []
    trace: list[str] = []
    version = 0
    kills_relay = 0

    def relaying() -> list[Worker]:
        """Live workers still receiving a version while a reader behind them has bytes of it."""
        return [w for w in workers if not w.dead and w.receiving() and w.peer._conns
                and P.IO_BYTES <= w.peer.newest().filled < w.peer.newest().total_bytes]

    def publish(big: bool = False) -> None:
        nonlocal version
        version += 1
        size = rng.choice([1, 2, 7, rng.randint(1, 300 * KiB), MiB - 1, MiB, MiB + 1, P.IO_BYTES // 8])
        if big:  # a holder serves on in whole IO_BYTES sends: more than one, to be caught between them
            size = rng.choice([P.IO_BYTES + 1, P.IO_BYTES + MiB // 2, P.IO_BYTES + MiB])
        data = rng.randbytes(size)
        published[version], sizes[version] = sha(data), size
        P.publish(trainer_client, RUN, "trainer", trainer, version, data)
        trace.append(f"publish v{version} {size}B")

    try:
        for i in range(rng.randint(2, 4)):
            workers.append(Worker(f"w{i}", coord.address, got, errors))
        publish()
        for step in range(rng.randint(6, 10)):
            op = rng.choices(["publish", "join", "kill", "kill_relay", "sleep", "dropped", "empty", "restart"],
                             weights=[3, 2, 1, 1.5, 2, 0.5, 0.3, 0.7])[0]
            if op == "kill_relay" and kills_relay >= 2:
                op = "publish"
            kills_relay += op == "kill_relay"
            trace.append(f"{step}:{op}")
            if op == "publish":
                publish()
            elif op == "join":
                workers.append(Worker(f"w{len(workers)}", coord.address, got, errors))
            elif op in ("kill", "kill_relay"):
                if op == "kill_relay":  # a new version, and a worker dies while it relays it to another
                    publish(big=True)
                    give_up = time.monotonic() + 1.5
                    while not relaying() and time.monotonic() < give_up:
                        time.sleep(0.005)
                live = [w for w in workers if not w.dead]
                if len(live) > 1:  # keep one worker alive to check the end state through
                    busy = relaying() or [w for w in live if w.receiving()]
                    victim = rng.choice(busy or live)
                    trace.append(f"  kill {victim.name} (receiving: {victim.receiving()}, readers: {len(victim.peer._conns)})")
                    victim.kill()
            elif op == "sleep":
                time.sleep(rng.uniform(0.02, 0.3))
            elif op == "dropped" and version > P.KEEP_VERSIONS:
                # a reader asking the trainer directly for a version it no longer keeps is told so
                old = version - P.KEEP_VERSIONS
                held = P.Held(old, "0" * 64, sizes[old])
                # (newest: the trainer's peer, which also holds a blob whose announce was refused, see below)
                newest = trainer.newest().version
                with pytest.raises(P.PeerError, match=rf"version {old} is not held here \(newest: {newest}\)"):
                    P.read_from(trainer.address, held, P._Verifier(held), run_id=RUN, token=None)
                assert held.filled == 0
            elif op == "empty":
                # an empty blob is refused by the coordinator, naming the field; the version stays free
                with pytest.raises(InvalidRequestError, match="total_bytes: 0 must be >= 1"):
                    P.publish(trainer_client, RUN, "trainer", trainer, version + 1, b"")
            elif op == "restart":
                coord.restart()  # the directory is in memory: the next announce / locate rebuild it
                if rng.random() < 0.5:
                    publish()
        publish()  # the last version: every live worker must end up with it
        last = version
        live = [w for w in workers if not w.dead]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(w.have < last for w in live):
            time.sleep(0.05)
        stuck = {w.name: (w.have, w.peer.newest() and (w.peer.newest().version, w.peer.newest().filled)) for w in live
                 if w.have < last}
        assert not stuck, f"live workers without v{last} after 20s: {stuck}; errors {errors}; {trace}"
    finally:
        for w in workers:
            w.close()
        hung = [w.name for w in workers if w.thread.is_alive()]
        trainer.close()
        trainer_client.close()
        coord.close()
    assert not hung, f"workers whose fetch did not return: {hung}"
    # Every fetch that returned was complete, byte-identical to what was published as its version,
    # newer than what the worker held.
    for name, dead, have, v, complete, digest, total, sources in got:
        assert complete and v > have, (name, have, v)
        assert digest == published[v] and total == sizes[v], (name, v, sources, trace)
        covered = sorted((a, b) for _, a, b in sources if b > a)
        assert covered[0][0] == 0 and covered[-1][1] == total, (name, v, sources)
        assert all(x[1] == y[0] for x, y in zip(covered, covered[1:])), (name, v, sources)  # resumed at the offset
    # Only a killed worker's fetch may fail; a live one always had the trainer to fall back to.
    assert not [e for e in errors if not e[1]], f"{errors}; {trace}"


# -- the bugs the schedules above found, each fixed -------------------------------------------------------


def test_a_source_that_moved_on_is_not_dropped_as_a_holder_of_the_newest(monkeypatch):
    """The trainer publishes twice between a reader's locate (naming version 1) and its connect:
    the trainer keeps ``KEEP_VERSIONS`` = 2, so it answers "version 1 is not held here (newest: 3)".
    The fetch should go on to version 3, which the trainer serves; "A source that fails is reported
    unreachable and the read resumes from another" should not turn a healthy trainer into no source."""
    from tests.unit.test_weights_relay import DirectoryClient

    monkeypatch.setattr(P, "LOCATE_WAIT_S", 0.1)

    class RacingClient(DirectoryClient):
        def __init__(self, trainer):
            super().__init__()
            self.trainer, self.raced = trainer, False

        def locate_weights(self, run_id, **kw):
            reply = super().locate_weights(run_id, **kw)
            if reply is not None and not self.raced:  # between the locate and the connect
                self.raced = True
                for v in (2, 3):
                    P.publish(self, run_id, "trainer", self.trainer, v, blobs[v])
            return reply

    blobs = {v: random.Random(v).randbytes(1000 + v) for v in (1, 2, 3)}
    with P.WeightPeer(stall_timeout_s=0.2) as trainer, P.WeightPeer() as reader:
        client = RacingClient(trainer)
        P.publish(client, "r", "trainer", trainer, 1, blobs[1])
        try:
            held = P.fetch(client, "r", "reader", reader, have_version=-1, wait_s=1, token=None,
                           stall_timeout_s=0.5, resume_timeout_s=1.0)
        finally:
            holders = [h.member_id for h in client.wd.holders("r")]
        assert "trainer" in holders, f"the trainer, serving version 3, was dropped from the directory: {holders}"
        assert held is not None and held.version == 3 and bytes(held.buf) == blobs[3]


def test_a_refused_publish_does_not_replace_what_the_trainer_serves(monkeypatch):
    from tests.unit.test_weights_relay import DirectoryClient

    monkeypatch.setattr(P, "LOCATE_WAIT_S", 0.1)
    good, other = random.Random(1).randbytes(3000), random.Random(2).randbytes(3000)
    with P.WeightPeer(stall_timeout_s=0.2) as trainer, P.WeightPeer() as reader:
        client = DirectoryClient()
        P.publish(client, "r", "trainer", trainer, 1, good)
        with pytest.raises(FencedError, match="version 1"):
            P.publish(client, "r", "trainer", trainer, 1, other)  # a stale trainer's retry: refused
        held = P.fetch(client, "r", "reader", reader, have_version=-1, wait_s=1, token=None,
                       stall_timeout_s=0.5, resume_timeout_s=1.0)
        assert held is not None and bytes(held.buf) == good
