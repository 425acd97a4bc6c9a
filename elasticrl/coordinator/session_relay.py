"""The session relay: one Session stream to the coordinator for the sessions of every member on a node.

A Session stream per member costs the coordinator gRPC's per-message work twice per member and
barrier (the arrival read, the release written): at 512 members that, not the barrier logic, is
most of a barrier's time (``bench/coordinator.py --profile``). A node hosts several members (a
trainer rank per GPU), so its agent (the torchrun agent, or ``elasticrl session-relay``) runs
this relay and its members' ``Membership`` talk to it over a Unix socket: the coordinator reads and
writes one message per node, batched, whatever the node's member count, and a barrier's decided
answer goes to each node once (``SessionResponseBatch.shared``).

The local protocol is the Session protocol itself, framed: each message is a 4-byte big-endian
length and a serialized ``SessionRequest`` (member -> relay) or ``SessionResponse`` (relay ->
member), never batched on this side. A connection is one member's stream and means what a
stream would:

* every request goes upstream under an id of the relay's (the answer gets the member's back);
  what arrives in one turn of the event loop goes as one batch message
  (``aio_session.batched_requests``);
* a connection that ends is a stream that ends: each member whose keep-alives it carried is
  detached upstream (``SessionDetach``), ``broken`` unless it sent ``close``, so a killed worker
  is evicted after the coordinator's stream grace exactly as with a stream of its own;
* the upstream stream opens when a member connects. If it cannot open, or breaks (coordinator
  restart), every member connection is closed: members reopen through the relay, which opens a
  new stream, and meanwhile arrive by unary calls, as after any broken stream.

Access: the socket is created mode 0600 (``start_in_thread`` puts it in a fresh 0700 directory),
so only its user's processes reach it; the relay holds the coordinator token and members need
none. Nothing but protobuf crosses it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterator

import grpc
from google.protobuf.message import DecodeError

from elasticrl._proto import coordinator_pb2 as pb
from elasticrl._proto import coordinator_pb2_grpc as pb_grpc
from elasticrl.coordinator import wire
from elasticrl.coordinator.aio_session import batched_requests
from elasticrl.owned_dirs import OwnedDir

log = logging.getLogger(__name__)

ENV = "ELASTICRL_SESSION_RELAY"
"""Set by a node agent that runs a relay to its socket's path: its workers' ``Membership`` use it."""
FOR_ENV = "ELASTICRL_SESSION_RELAY_FOR"
"""The coordinator address that relay serves: a ``Membership`` of another coordinator ignores it."""

_HEADER = struct.Struct(">I")
MAX_REQUEST_BYTES = 1 << 20
"""A member's request frame is at most this long (they are tens of bytes); longer ends its connection."""
RELAY_DIR_PREFIX = "elasticrl-relay-"
MAX_SOCKET_DIR_BYTES = 90
"""A Unix socket's path is at most 107 bytes on Linux: a longer temp dir gives way to /tmp."""
MAX_BUFFERED_BYTES = 16 << 20
"""Answers a member has not read: past this the relay drops its connection (it reopens)."""


def frame(data: bytes) -> bytes:
    return _HEADER.pack(len(data)) + data


def _id_prefix(request_id: int) -> bytes:
    return pb.SessionResponse(id=request_id).SerializeToString()


class _Member:
    """One member connection: its writer, the members its keep-alives named, its requests upstream."""

    __slots__ = ("writer", "members", "said_close", "ids")

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.members: set[tuple[str, str, int]] = set()
        self.said_close = False
        self.ids: set[int] = set()  # relay ids of its requests not answered yet

    def send(self, data: bytes) -> None:
        if self.writer.is_closing():
            return
        self.writer.write(frame(data))
        queued = self.writer.transport.get_write_buffer_size()
        if queued > MAX_BUFFERED_BYTES:
            log.warning("relay: a member does not read its answers (%d bytes queued); closing its connection", queued)
            self.writer.transport.abort()


class SessionRelay:
    """Serve members on a Unix socket (``start``) and carry their sessions on one stream to the
    coordinator at ``address``. Use it from one event loop."""

    def __init__(self, address: str, *, token: str | None = None, tls_ca: str | None = None,
                 call_timeout_s: float = 10.0, max_message_bytes: int = wire.MAX_MESSAGE_BYTES):
        self.address = address
        self.call_timeout_s = call_timeout_s
        self._metadata = wire.auth_metadata(token)  # resolved by the caller (client.resolve_token)
        self._channel = wire.open_channel(address, tls_ca, aio=True, max_message_bytes=max_message_bytes)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Member] = set()
        self._routes: dict[int, tuple[_Member, int]] = {}  # relay id -> (connection, member's id)
        # Connections whose keep-alives named each member: a member that reconnected while its
        # old connection was still open is detached only when the last one ends.
        self._carriers: collections.Counter = collections.Counter()
        self._ids = itertools.count(1)
        self._outbox: asyncio.Queue | None = None  # the upstream stream's, while it is up
        self._held: list[pb.SessionRequest] = []  # requests while the upstream stream opens
        self._upstream: asyncio.Task | None = None
        self.streams_opened = 0

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._serve_member, path=path)
        os.chmod(path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.writer.transport.abort()
        if self._upstream is not None:
            self._upstream.cancel()
            await asyncio.gather(self._upstream, return_exceptions=True)
        await self._channel.close()

    # -- members -------------------------------------------------------------------------------

    async def _serve_member(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Member(writer)
        self._conns.add(conn)
        if self._upstream is None or self._upstream.done():
            self._upstream = asyncio.get_running_loop().create_task(self._run_upstream(), name="relay-upstream")
        try:
            while True:
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                if size > MAX_REQUEST_BYTES:
                    log.warning("relay: a member sent a %d-byte frame (limit %d); closing its connection", size, MAX_REQUEST_BYTES)
                    return
                self._forward(conn, pb.SessionRequest.FromString(await reader.readexactly(size)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # it closed or died: the same to the coordinator, told below
        except DecodeError:
            log.warning("relay: a member sent a frame that is not a SessionRequest; closing its connection")
        finally:
            self._conns.discard(conn)
            if self._outbox is None:  # no stream holds its session: nothing to detach, nothing to send
                self._held = [r for r in self._held if r.id not in conn.ids]
            for key in conn.members:
                self._carriers[key] -= 1
                if self._carriers[key] > 0:
                    continue
                del self._carriers[key]
                if self._outbox is not None:
                    run_id, member_id, incarnation = key
                    self._outbox.put_nowait(pb.SessionRequest(id=next(self._ids), detach=pb.SessionDetach(
                        run_id=run_id, member=wire.member_ref(member_id, incarnation), broken=not conn.said_close)))
            for rid in conn.ids:
                self._routes.pop(rid, None)
            writer.transport.abort()

    def _forward(self, conn: _Member, request: pb.SessionRequest) -> None:
        op = request.WhichOneof("op")
        if op == "close":
            conn.said_close = True
            return
        for one in request.batch.ops if op == "batch" else (request,):
            if one.WhichOneof("op") == "keep_alive":
                ka = one.keep_alive
                key = (ka.run_id, ka.member.member_id, ka.member.incarnation)
                if key not in conn.members:
                    conn.members.add(key)
                    self._carriers[key] += 1
            rid = next(self._ids)
            self._routes[rid] = (conn, one.id)
            conn.ids.add(rid)
            one.id = rid
            if self._outbox is not None:
                self._outbox.put_nowait(one)
            else:
                self._held.append(one)

    # -- the coordinator ---------------------------------------------------------------------

    async def _run_upstream(self) -> None:
        """One stream to the coordinator, for as long as it lasts; then every member connection is
        closed (each member reopens, which starts the next stream)."""
        outbox: asyncio.Queue = asyncio.Queue()
        call = self._stub.Session(batched_requests(outbox), metadata=self._metadata)
        detail, up = "the coordinator ended the stream", False
        try:
            try:
                async with asyncio.timeout(self.call_timeout_s):
                    await call.initial_metadata()
            except TimeoutError:
                call.cancel()
                detail = f"stream not opened within {self.call_timeout_s:.1f}s"
                return
            if not call.done():
                up = True
                self.streams_opened += 1
                self._outbox = outbox
                held, self._held = self._held, []
                for request in held:
                    outbox.put_nowait(request)
            async for resp in call:
                self._dispatch(resp)
        except grpc.RpcError as err:
            detail = f"{err.code().name}: {err.details()}"
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            self._outbox = None
            outbox.put_nowait(None)
            self._held.clear()
            self._routes.clear()
            # Never up: the coordinator is down, or refuses this relay (its token, its CA).
            log.log(logging.WARNING if not up else logging.INFO if self._conns else logging.DEBUG,
                    "relay: session stream to %s %s (%s); closing %d member connection(s)",
                    self.address, "ended" if up else "did not open", detail, len(self._conns))
            for conn in list(self._conns):
                conn.writer.transport.abort()  # their handlers detach nothing: no stream is up

    def _dispatch(self, resp: pb.SessionResponse) -> None:
        if resp.WhichOneof("result") != "batch":
            self._route(resp)
            return
        for one in resp.batch.results:
            self._route(one)
        for group in resp.batch.shared:  # a decided barrier: serialized once, an id per member
            wrapped = group.response.SerializeToString()
            for rid in group.ids:
                conn, member_rid = self._take(rid)
                if conn is not None:
                    conn.send(_id_prefix(member_rid) + wrapped)

    def _route(self, resp: pb.SessionResponse) -> None:
        conn, member_rid = self._take(resp.id)
        if conn is not None:
            resp.id = member_rid
            conn.send(resp.SerializeToString())
        elif resp.HasField("error"):  # a detach's (nothing else goes unrouted but a gone member's)
            log.warning("relay: the coordinator refused an operation: %s", resp.error.message)

    def _take(self, rid: int) -> tuple[_Member | None, int]:
        conn, member_rid = self._routes.pop(rid, (None, 0))
        if conn is not None:
            conn.ids.discard(rid)
        return conn, member_rid


class RelayThread:
    """A ``SessionRelay`` on its own event loop in a daemon thread, for a synchronous process (the
    torchrun agent): ``path`` is its socket, in a fresh directory only this user can enter."""

    def __init__(self, address: str, *, token: str | None = None, tls_ca: str | None = None, start_timeout_s: float = 10.0):
        # Mode 0700, and removed by the next relay on the host if this process is killed.
        self._dir = OwnedDir(RELAY_DIR_PREFIX, "session relay directories")
        if len(os.fsencode(self._dir.path)) > MAX_SOCKET_DIR_BYTES:  # a long $TMPDIR (a cluster's job dir)
            self._dir.remove()
            self._dir = OwnedDir(RELAY_DIR_PREFIX, "session relay directories", parent="/tmp")
        self.directory = self._dir.path
        self.path = os.path.join(self.directory, "session.sock")
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._relay: SessionRelay | None = None
        self._args = (address, token, tls_ca)
        self._thread = threading.Thread(target=self._main, name="elasticrl-relay", daemon=True)
        self._thread.start()
        if not self._started.wait(start_timeout_s):
            raise TimeoutError(f"session relay did not start within {start_timeout_s:.1f}s")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            address, token, tls_ca = self._args
            self._relay = SessionRelay(address, token=token, tls_ca=tls_ca)
            self._loop.run_until_complete(self._relay.start(self.path))
        except BaseException as exc:  # noqa: BLE001 - raised in the starting thread
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    @property
    def streams_opened(self) -> int:
        """Streams to the coordinator opened so far (one more after each coordinator restart)."""
        return 0 if self._relay is None else self._relay.streams_opened

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._relay is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._relay.close(), self._loop).result(timeout_s)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
        self._dir.remove()


def _whole(data: bytes, size: int) -> bytes:
    """``data`` if it is ``size`` bytes long: less means the connection ended inside a message."""
    if len(data) < size:
        raise ConnectionError("session relay closed the connection mid-message")
    return data


class RelayCall:
    """A member's Session stream through a relay, shaped like the blocking gRPC call it replaces
    (``member_stream.MemberStream``): iterate it for responses; ``requests`` is written from a
    thread of its own; ``cancel`` ends it. A failure raises ``OSError``."""

    def __init__(self, path: str, requests: Iterator[pb.SessionRequest], *, connect_timeout_s: float = 5.0):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(connect_timeout_s)
            self._sock.connect(path)
            self._sock.settimeout(None)
        except OSError:
            self._sock.close()
            raise
        self._requests = requests
        self._send_lock = threading.Lock()
        self._writer = threading.Thread(target=self._write, name="elasticrl-relay-write", daemon=True)
        self._writer.start()

    def send(self, request: pb.SessionRequest) -> None:
        """Write ``request`` now, from the calling thread (no hand-off to the writer thread, which a
        gRPC stream's requests need). Raises ``OSError`` if the connection is gone."""
        data = frame(request.SerializeToString())
        with self._send_lock:
            self._sock.sendall(data)

    def _write(self) -> None:
        try:
            for request in self._requests:
                self.send(request)
            with self._send_lock:
                self._sock.shutdown(socket.SHUT_WR)  # a half-close, as gRPC's end of requests
        except OSError:
            pass  # the reader sees the connection's end

    def __iter__(self) -> Iterator[pb.SessionResponse]:
        reader = self._sock.makefile("rb")
        try:
            while True:
                header = reader.read(_HEADER.size)
                if not header:
                    return  # the relay ended the stream
                (size,) = _HEADER.unpack(_whole(header, _HEADER.size))
                yield pb.SessionResponse.FromString(_whole(reader.read(size), size))
        finally:
            reader.close()
            self.cancel()

    def cancel(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
