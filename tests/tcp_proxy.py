"""A TCP proxy for tests in front of a coordinator: it can reset every connection through it at
once (a network blip: an RST, as a crashed peer sends) and drop what the coordinator sends back
(``drop_replies``: a one-way loss). While the target is down, a new connection is accepted and
closed at once (the client retries)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class TcpProxy:
    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.drop_replies = False
        self.closed = False
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []  # joined by close: a test can check none is left
        self._spawn(self._accept, f"proxy-accept-{self.port}")

    def _spawn(self, target, name, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self.lock:
            self.threads = [x for x in self.threads if x.is_alive()] + [t]
        t.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target, timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns += [client, upstream]
            self._spawn(self._pipe, "proxy-pipe", client, upstream, False)
            self._spawn(self._pipe, "proxy-pipe", upstream, client, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if replies and self.drop_replies:
                    continue
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)

    def reset_all(self) -> int:
        """Reset every connection through the proxy; returns how many sockets there were."""
        with self.lock:
            conns, self.conns = self.conns, []
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
                sock.shutdown(socket.SHUT_RDWR)  # wakes the pipe threads blocked in recv on it
            sock.close()
        return len(conns)

    def close(self) -> None:
        self.closed = True
        self.drop_replies = False
        self.listener.close()
        self.reset_all()
        with self.lock:
            threads = list(self.threads)
        for t in threads:
            t.join(5)
