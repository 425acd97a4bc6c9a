"""Policy weights between peers over plain TCP: every holder serves, every fetcher reads behind one.

``WeightPeer`` is a small threaded TCP server that serves the versions this process holds (the
trainer's rank 0 serves each version it publishes; a rollout worker serves the one it fetched).
A version still being received is served too, up to the bytes it has: the reader blocks until
more arrive, so fetchers that read behind each other form a pipeline. ``fetch`` asks the
coordinator's directory (``LocateWeights``) for a source, reads the blob from it into a ``Held``
that this process's own ``WeightPeer`` serves at once, resumes from another source at the same
offset when the first dies or stalls (reporting it unreachable), verifies it and announces the
version complete. Nothing is pickled: the blob is the trainer's safetensors file, byte for byte.

Integrity: a blob is cut into pieces of ``PIECE_BYTES``; its digest (the ``sha256`` the
coordinator holds) is the SHA-256 of the pieces' SHA-256s (``blob_digest``). A reader gets the
piece list from its source, checks it against the digest, and hashes each piece on a thread pool
as soon as it is complete, while the rest still arrives: one SHA-256 over a 16 GB blob would take
~16 s on one core, pieces hash on every core (hashlib releases the GIL).

Wire format, one request per connection: the reader sends ``<u32 length><JSON>`` with ``token``,
``run_id``, ``version`` and ``offset``; the holder answers ``<u32 length><JSON>`` (``ok``,
``total_bytes``, ``digest``, ``pieces``, or ``error``) and then the bytes from ``offset`` to the
end. The token is the coordinator's (compared in constant time); like NCCL's transport the bytes
are not encrypted, so keep the relay port on the cluster network.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

from elasticrl.errors import ElasticRLError

log = logging.getLogger(__name__)

PROTOCOL = "elasticrl-weights/1"
IO_BYTES = 4 << 20
"""Largest single send or receive."""
PIECE_BYTES = 16 << 20
"""Pieces hashed on their own (a 16 GB blob has 1024)."""
MAX_HEADER_BYTES = 4 << 20
CONNECT_TIMEOUT_S = 5.0
STALL_TIMEOUT_S = 10.0
"""A source that sends no byte for this long counts as unreachable (a stopped or partitioned host)."""
RESUME_TIMEOUT_S = 60.0
"""A transfer under way gives up when no source delivered a byte for this long."""
LOCATE_WAIT_S = 2.0
NOT_HELD_PAUSE_S = 0.1
"""After a source answered that it moved past the version asked for, before asking the coordinator again."""
REANNOUNCE_S = 30.0
"""A worker with nothing new to fetch says again what it holds this often: a coordinator that
restarted (holders are kept in memory only) learns its sources back without a new publish."""
KEEP_VERSIONS = 2
"""Versions a peer keeps serving: the newest, and the one before for readers still on it."""
_LEN = struct.Struct("<I")


class PeerError(ElasticRLError):
    """A weight source refused the request, broke off or stalled, or sent a wrong blob."""


class NotHeldError(PeerError):
    """A source answered that it does not hold the version asked for (it moved on to newer ones):
    it is alive, so ``fetch`` does not report it unreachable; it asks the coordinator again."""


class Held:
    """One version's bytes in this process: complete, or being received (``filled`` so far)."""

    def __init__(self, version: int, digest: str, total_bytes: int, data: bytes | bytearray | memoryview | None = None,
                 pieces: list[str] | None = None):
        if data is not None and len(data) != total_bytes:
            raise ValueError(f"data: {len(data)} bytes, expected total_bytes = {total_bytes}")
        self.version = version
        self.digest = digest
        self.pieces = pieces
        """Hex SHA-256 of each piece: known for a complete blob, from the source for one arriving."""
        self.total_bytes = total_bytes
        # An anonymous mapping: its pages are zeroed by the kernel as the bytes land, not all up
        # front (bytearray(n) writes n zeros first: ~1 s for a 512 MiB blob on a busy host).
        self.buf = mmap.mmap(-1, total_bytes) if data is None else data
        self.filled = total_bytes if data is not None else 0
        self.complete = data is not None
        self.failed = False
        self.sources: list[tuple[str, int, int]] = []
        """Where a fetched version came from: (source member, first byte, end byte) per source."""
        self._cond = threading.Condition()

    def view(self) -> memoryview:
        return memoryview(self.buf).cast("B")

    def wrote(self, n: int) -> None:
        with self._cond:
            before, self.filled = self.filled, self.filled + n
            # Readers wait for whole IO_BYTES sends: wake them once per MiB, not per receive.
            if self.filled >> 20 != before >> 20 or self.filled == self.total_bytes:
                self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self.complete = True
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self.failed = True
            self._cond.notify_all()

    def set_pieces(self, pieces: list[str]) -> None:
        with self._cond:
            self.pieces = pieces
            self._cond.notify_all()

    def wait_pieces(self, timeout_s: float) -> list[str]:
        with self._cond:
            if not self._cond.wait_for(lambda: self.pieces is not None or self.failed, timeout=timeout_s):
                raise PeerError(f"version {self.version}: its piece list did not arrive within {timeout_s:.0f}s")
            if self.failed:
                raise PeerError(f"version {self.version}: this holder's own fetch failed")
            return self.pieces

    def wait_past(self, pos: int, timeout_s: float, want: int = 1) -> int:
        """The bytes received once there are ``want`` more than ``pos`` (or all of them);
        ``PeerError`` if the fetch of this version failed or no byte came within ``timeout_s``."""
        target = min(pos + want, self.total_bytes)
        with self._cond:
            while self.filled < target and not self.failed:
                before = self.filled
                if not self._cond.wait_for(lambda: self.filled >= target or self.failed, timeout=timeout_s) and self.filled == before:
                    raise PeerError(f"version {self.version}: no new byte past {before} for {timeout_s:.0f}s")
            if self.failed:
                raise PeerError(f"version {self.version}: this holder's own fetch failed")
            return self.filled


_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2),
                                                          thread_name_prefix="weights-hash")
        return _pool


def _piece_hash(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


def piece_views(data, total_bytes: int) -> list[memoryview]:
    view = memoryview(data).cast("B")
    return [view[i:i + PIECE_BYTES] for i in range(0, total_bytes, PIECE_BYTES)]


def piece_digests(data) -> list[str]:
    """Hex SHA-256 of each ``PIECE_BYTES`` piece of ``data``, hashed on every core."""
    return list(hash_pool().map(_piece_hash, piece_views(data, len(data))))


def blob_digest(pieces: list[str]) -> str:
    """The blob's digest: SHA-256 over its piece size and its pieces' SHA-256s."""
    h = hashlib.sha256(f"elasticrl-pieces/1 {PIECE_BYTES}\n".encode())
    for p in pieces:
        h.update(bytes.fromhex(p))
    return h.hexdigest()


class _Verifier:
    """Hashes each piece of an arriving blob on the pool once its last byte is in."""

    def __init__(self, held: Held):
        self.held = held
        self.views = piece_views(held.buf, held.total_bytes)
        self.futures: list[concurrent.futures.Future] = []

    def received(self, upto: int) -> None:
        while len(self.futures) < len(self.views) and min((len(self.futures) + 1) * PIECE_BYTES, self.held.total_bytes) <= upto:
            self.futures.append(hash_pool().submit(_piece_hash, self.views[len(self.futures)]))

    def bad_pieces(self) -> list[int]:
        expected = self.held.pieces or []
        return [i for i, f in enumerate(self.futures) if i >= len(expected) or f.result() != expected[i]]


def _send_json(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerError(f"the connection closed after {got} of {n} header bytes")
        got += k
    return bytes(out)


def _recv_json(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_HEADER_BYTES:
        raise PeerError(f"a {n}-byte header, at most {MAX_HEADER_BYTES}: not an elasticrl weight peer?")
    try:
        obj = json.loads(_recv_exact(sock, n))
    except ValueError as exc:
        raise PeerError(f"a header that is not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise PeerError("a header that is not a JSON object")
    return obj


class WeightPeer:
    """Serves this process's versions to other peers: one daemon thread per connection."""

    def __init__(self, *, token: str | None = None, host: str = "", port: int = 0, advertise_host: str = "127.0.0.1",
                 keep: int = KEEP_VERSIONS, stall_timeout_s: float = STALL_TIMEOUT_S, rate_limit_bytes_s: float = 0.0):
        """``rate_limit_bytes_s``: a cap on what each reader is sent per second (0: none), to
        leave bandwidth to training traffic that shares the link."""
        self.token = token or ""
        self.rate_limit_bytes_s = rate_limit_bytes_s
        self.keep = max(1, keep)
        self.stall_timeout_s = stall_timeout_s
        self._sock = socket.create_server((host, port), backlog=256)
        self.port = self._sock.getsockname()[1]
        self.address = f"[{advertise_host}]:{self.port}" if ":" in advertise_host else f"{advertise_host}:{self.port}"
        self._held: dict[int, Held] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self.served_bytes = 0
        self.announced_at = -REANNOUNCE_S
        self._thread = threading.Thread(target=self._accept, name=f"weight-peer-{self.port}", daemon=True)
        self._thread.start()

    def __enter__(self) -> "WeightPeer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def hold(self, held: Held) -> None:
        """Serve ``held`` from now on; forget all but the newest ``keep`` versions."""
        with self._cond:
            self._held[held.version] = held
            for old in sorted(self._held)[:-self.keep]:
                del self._held[old]
            self._cond.notify_all()

    def drop(self, held: Held) -> None:
        with self._cond:
            if self._held.get(held.version) is held:
                del self._held[held.version]

    def get(self, version: int, timeout_s: float = 0.0) -> Held | None:
        """The held version, waiting up to ``timeout_s`` for it (a reader can connect in the
        moment between this process being named as a source and it starting its fetch)."""
        with self._cond:
            self._cond.wait_for(lambda: version in self._held or self._closed, timeout=timeout_s)
            return self._held.get(version)

    def newest(self) -> Held | None:
        with self._cond:
            return self._held[max(self._held)] if self._held else None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            conns = list(self._conns)
        try:
            self._sock.close()
        except OSError:
            pass
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._cond:
                self._conns.add(conn)
            threading.Thread(target=self._serve_one, args=(conn,), name="weight-peer-conn", daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.stall_timeout_s)
            self._serve(conn)
        except (OSError, PeerError) as exc:
            log.debug("weight peer %s: a reader went away: %s", self.address, exc)
        finally:
            with self._cond:
                self._conns.discard(conn)
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        req = _recv_json(conn)
        if self.token and not hmac.compare_digest(str(req.get("token", "")).encode(), self.token.encode()):
            _send_json(conn, {"ok": False, "error": "token: wrong or missing (use the coordinator's token)"})
            return
        try:
            version, offset = int(req["version"]), int(req["offset"])
        except (KeyError, TypeError, ValueError):
            _send_json(conn, {"ok": False, "error": "version, offset: both must be integers"})
            return
        held = self.get(version, timeout_s=self.stall_timeout_s)
        if held is None:
            newest = self.newest()
            _send_json(conn, {"ok": False, "not_held": True,
                              "error": f"version {version} is not held here (newest: {newest.version if newest else 'none'})"})
            return
        if not 0 <= offset <= held.total_bytes:
            _send_json(conn, {"ok": False, "error": f"offset: {offset} must be in 0..{held.total_bytes}"})
            return
        pieces = held.wait_pieces(self.stall_timeout_s)
        _send_json(conn, {"ok": True, "total_bytes": held.total_bytes, "digest": held.digest, "pieces": pieces})
        view, pos = held.view(), offset
        step = IO_BYTES if not self.rate_limit_bytes_s else max(1, min(IO_BYTES, int(self.rate_limit_bytes_s / 20)))
        start = time.monotonic()
        while pos < held.total_bytes:
            # Whole IO_BYTES sends from a version still arriving: fewer, larger writes and wake-ups.
            filled = held.filled if held.filled >= min(pos + step, held.total_bytes) else held.wait_past(pos, self.stall_timeout_s, step)
            end = min(filled, pos + step)
            conn.sendall(view[pos:end])
            self.served_bytes += end - pos
            pos = end
            if self.rate_limit_bytes_s:
                ahead = (pos - offset) / self.rate_limit_bytes_s - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)


def read_from(addr: str, held: Held, verifier: _Verifier, *, run_id: str, token: str | None,
              stall_timeout_s: float = STALL_TIMEOUT_S, on_bytes: Callable[[int], None] | None = None) -> None:
    """Read ``held``'s version from the peer at ``addr``, from ``held.filled`` to the end, into
    ``held`` (each piece handed to ``verifier`` once complete). ``OSError`` or ``PeerError`` when
    the source fails: what was received stays, so a retry elsewhere resumes there."""
    host, _, port = addr.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S) as s:
        s.settimeout(stall_timeout_s)
        _send_json(s, {"protocol": PROTOCOL, "token": token or "", "run_id": run_id, "version": held.version,
                       "offset": held.filled})
        header = _recv_json(s)
        if not header.get("ok"):
            error = NotHeldError if header.get("not_held") else PeerError
            raise error(f"weight source {addr}: {header.get('error', 'refused')}")
        pieces = header.get("pieces")
        if (header.get("total_bytes") != held.total_bytes or header.get("digest") != held.digest
                or not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces)
                or len(pieces) != -(-held.total_bytes // PIECE_BYTES) or blob_digest(pieces) != held.digest):
            raise PeerError(f"weight source {addr} holds another blob under version {held.version}")
        if held.pieces is None:
            held.set_pieces(pieces)
        view, total = held.view(), held.total_bytes
        pos = held.filled
        while pos < total:
            n = s.recv_into(view[pos:], min(IO_BYTES, total - pos))
            if n == 0:
                raise PeerError(f"weight source {addr} closed the connection at byte {pos} of {total}")
            pos += n
            held.wrote(n)
            verifier.received(pos)
            if on_bytes is not None:
                on_bytes(pos)


def fetch(client, run_id: str, member_id: str, peer: WeightPeer, *, have_version: int, wait_s: float,
          token: str | None, stop: threading.Event | None = None, stall_timeout_s: float = STALL_TIMEOUT_S,
          resume_timeout_s: float = RESUME_TIMEOUT_S, on_bytes: Callable[[int], None] | None = None) -> Held | None:
    """The run's newest version if newer than ``have_version``, from whichever peer the
    coordinator names, waiting up to ``wait_s`` for one; None if none came (or ``stop`` was set).

    ``client``: a ``SchedulerClient``. The returned ``Held`` is complete, verified, served by
    ``peer`` and announced as complete. A source that fails is reported unreachable and the read
    resumes from another at the same offset; once a transfer started, it goes on (past
    ``wait_s``) as long as some source delivers a byte every ``resume_timeout_s``, else
    ``PeerError``. A blob with a piece that does not match its SHA-256 is thrown away and fetched
    again from another source.
    """
    give_up = time.monotonic() + wait_s
    unreachable: list[str] = []
    held, verifier = None, None
    progress_at = time.monotonic()
    try:
        while True:
            if stop is not None and stop.is_set():
                return None
            now = time.monotonic()
            wait = max(0.0, min(give_up - now, LOCATE_WAIT_S)) if held is None else LOCATE_WAIT_S
            src = client.locate_weights(run_id, member_id=member_id, address=peer.address, have_version=have_version,
                                        wait_s=wait, unreachable=unreachable)
            unreachable = []
            if src is None:
                if held is None:
                    _reannounce(client, run_id, member_id, peer)
                if held is None and time.monotonic() >= give_up:
                    return None
                if held is not None and time.monotonic() - progress_at > resume_timeout_s:
                    raise PeerError(f"weights of run {run_id!r}: no source delivered version {held.version:#x} for "
                                    f"{resume_timeout_s:.0f}s ({held.filled} of {held.total_bytes} bytes received)")
                continue
            if held is None or held.version != src.version:
                if held is not None:  # a newer version came while reading an older one: read that
                    held.fail()
                    peer.drop(held)
                held = Held(src.version, src.sha256, src.total_bytes)
                verifier = _Verifier(held)
                peer.hold(held)
                progress_at = time.monotonic()
            first = held.filled
            try:
                read_from(src.address, held, verifier, run_id=run_id, token=token, stall_timeout_s=stall_timeout_s,
                          on_bytes=on_bytes)
            except NotHeldError as exc:
                # Alive, and past this version: the coordinator names a newer one (or, until the
                # announce of that reaches it, this source again: hence the pause).
                log.info("weights of run %s version %#x: %s; asking again", run_id, held.version, exc)
                if stop is None:
                    time.sleep(NOT_HELD_PAUSE_S)
                elif stop.wait(NOT_HELD_PAUSE_S):
                    return None
                continue
            except (OSError, PeerError) as exc:
                held.sources.append((src.source_member, first, held.filled))
                if held.filled > first:
                    progress_at = time.monotonic()
                log.warning("weights of run %s version %#x: source %s (%s) failed at byte %d of %d: %s; asking for another",
                            run_id, held.version, src.source_member, src.address, held.filled, held.total_bytes, exc)
                unreachable = [src.address]
                continue
            held.sources.append((src.source_member, first, held.filled))
            bad = verifier.bad_pieces()
            if bad:
                log.error("weights of run %s version %#x from %s: %d pieces (first: %d) do not match their sha256; "
                          "fetching again from another source", run_id, held.version, src.address, len(bad), bad[0])
                held.fail()
                peer.drop(held)
                held, unreachable = None, [src.address]
                continue
            held.finish()
            _announce(client, run_id, member_id, peer, held)
            return held
    except BaseException:
        if held is not None and not held.complete:
            held.fail()
            peer.drop(held)
        raise


def _reannounce(client, run_id: str, member_id: str, peer: WeightPeer) -> None:
    held = peer.newest()
    if held is None or not held.complete or time.monotonic() - peer.announced_at < REANNOUNCE_S:
        return
    _announce(client, run_id, member_id, peer, held)


def _announce(client, run_id: str, member_id: str, peer: WeightPeer, held: Held) -> None:
    """Tell the coordinator that ``peer`` serves all of ``held``."""
    client.announce_weights(run_id, held.version, total_bytes=held.total_bytes, sha256=held.digest, member_id=member_id,
                            address=peer.address, complete=True)
    peer.announced_at = time.monotonic()


def publish(client, run_id: str, member_id: str, peer: WeightPeer, version: int, blob: bytes | bytearray | memoryview) -> Held:
    """Serve ``blob`` as ``version`` from ``peer`` and announce it: the trainer's side.

    Announced before it is served: one the coordinator refuses (another blob under a published
    version, an empty one) is never served and pushes no older version out of ``peer``. A reader
    named as the announce lands waits for it in ``WeightPeer.get``."""
    pieces = piece_digests(blob)
    held = Held(version, blob_digest(pieces), len(blob), blob, pieces)
    _announce(client, run_id, member_id, peer, held)
    peer.hold(held)
    return held


def advertise_host(coordinator_address: str, configured: str = "") -> str:
    """The host other peers reach this process at: ``configured`` if set; else the local address
    of the interface that routes to the coordinator (loopback for a local coordinator)."""
    if configured:
        return configured
    host = coordinator_address.rpartition(":")[0].strip("[]") or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        return route_source(host)
    except OSError:
        return socket.gethostname()


def route_source(host: str) -> str:
    """The local address the kernel sends from to reach ``host`` (``OSError`` if it cannot)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent; the kernel only picks the route
        return s.getsockname()[0]
