"""Network namespaces that stand in for hosts, so a multi-host run can be tested on one machine.

Each host is a network namespace with its own loopback and one veth interface (``eth0``) holding
its address on a shared /24. The other end of every veth is plugged into a bridge that lives in a
namespace of its own (the "switch"), not in the machine's namespace: the test adds no bridge,
route or firewall rule there, the machine's own firewall cannot drop bridged traffic, and deleting
the namespaces removes every trace (a namespace's interfaces go with it). Two hosts can reach each
other only over that bridge, so a process that talks to another host's address really crossed the
network; what hosts still share is the filesystem and the hostname (which resolves to 127.0.0.1
here, so programs that look up "my address" from the hostname must be told it).

Processes run on a host through ``ip netns exec``; ``Host.kill_all`` SIGKILLs every process inside
a host's namespace (``ip netns pids``): a whole machine dying, including processes that were
started in sessions of their own. Names carry the test process's pid and a counter, so parallel
runs and leftovers of a killed run never collide. Creating namespaces needs root and iproute2;
``NetnsUnavailable`` says why a machine cannot, and tests skip on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import itertools
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Mapping, Sequence

HOST_IFNAME = "eth0"
"""Name of each host's interface to the shared /24 (interface names are per namespace)."""
IP_TIMEOUT_S = 10.0
"""Deadline of one ``ip`` command."""
KILL_TIMEOUT_S = 10.0
"""How long ``Host.kill_all`` keeps killing (a dying agent may still start a worker) before failing."""
TCP_ESTABLISHED = "01"
"""State column of an established connection in /proc/PID/net/tcp{,6}."""

_serial = itertools.count()


class NetnsUnavailable(RuntimeError):
    """This machine cannot create network namespaces, bridges or veths; the message says why."""


def _ip(*args: str, unavailable: str | None = None) -> str:
    """Run ``ip ARGS``; raise NetnsUnavailable (with ``unavailable`` as the reason) or RuntimeError
    on failure, quoting the command and its stderr."""
    cmd = ["ip", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except FileNotFoundError:
        raise NetnsUnavailable("no `ip` binary (iproute2) on PATH") from None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(cmd)}` did not finish within {IP_TIMEOUT_S:g}s") from None
    if done.returncode != 0:
        problem = f"`{' '.join(cmd)}` failed with status {done.returncode}: {done.stderr.strip()}"
        if unavailable is not None:
            raise NetnsUnavailable(f"{unavailable}: {problem}")
        raise RuntimeError(problem)
    return done.stdout


@dataclasses.dataclass(frozen=True)
class Host:
    """One simulated machine: a network namespace with ``addr`` on ``ifname``."""

    name: str
    """Short name in the test (``coordinator``, ``node1``, ...)."""
    netns: str
    """The namespace's name, unique to this test run."""
    addr: str
    """Its IPv4 address on the shared /24."""
    ifname: str = HOST_IFNAME

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec`` execs it: the pid stays the program's)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def start(
        self, argv: Sequence[str], log_path: str | os.PathLike, *, env: Mapping[str, str], cwd: str | os.PathLike
    ) -> subprocess.Popen:
        """Start ``argv`` on this host in a session (process group) of its own, output to ``log_path``."""
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                self.command(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=dict(env), cwd=cwd, start_new_session=True,
            )

    def pids(self) -> list[int]:
        """Every process inside this host's namespace."""
        return [int(p) for p in _ip("netns", "pids", self.netns).split()]

    def kill_all(self, timeout_s: float = KILL_TIMEOUT_S) -> list[int]:
        """SIGKILL every process on this host until none is left; returns the pids killed.
        RuntimeError if processes still appear after ``timeout_s``."""
        killed: list[int] = []
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {self.name} ({self.netns}) still runs {pids} after {timeout_s:g}s of SIGKILLs")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed += [p for p in pids if p not in killed]
            time.sleep(0.02)  # a killed process leaves the namespace once the kernel reaps it
        return killed


class VirtualLan:
    """Hosts on one /24 behind a bridge in a namespace of its own; ``down()`` removes it all.

    ``VirtualLan(["coordinator", "node1"]).up()`` gives the hosts ``PREFIX.1``, ``PREFIX.2``, ... in
    that order. Use as a context manager, or call ``down()`` in a ``finally``.
    """

    def __init__(self, names: Sequence[str], *, prefix: str = "10.77.0"):
        if len(set(names)) != len(names) or not 1 <= len(names) <= 250:
            raise ValueError(f"names: {list(names)!r} must be 1..250 distinct host names")
        tag = f"erl{os.getpid()}x{next(_serial)}"
        self.switch = f"{tag}-switch"
        self.hosts: dict[str, Host] = {
            name: Host(name=name, netns=f"{tag}-{name}", addr=f"{prefix}.{i}") for i, name in enumerate(names, start=1)
        }
        ipaddress.ip_network(f"{prefix}.0/24")  # a bad prefix fails here, before anything is made
        self.prefix = prefix
        self._made: list[str] = []

    def __enter__(self) -> "VirtualLan":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "VirtualLan":
        """Create the switch and every host. NetnsUnavailable when the machine does not allow it
        (found by trying); whatever was made is removed again before any error is raised."""
        if shutil.which("ip") is None:
            raise NetnsUnavailable("no `ip` binary (iproute2) on PATH")
        try:
            self._make_switch()
            for port, host in enumerate(self.hosts.values(), start=1):
                self._make_host(host, f"p{port}")
        except BaseException as exc:
            try:
                self.down()
            except RuntimeError as cleanup:
                exc.add_note(str(cleanup))
            raise
        return self

    def _make_switch(self) -> None:
        uid = os.geteuid()
        who = "" if uid == 0 else f" as uid {uid} (not root)"
        _ip("netns", "add", self.switch, unavailable=f"cannot create a network namespace{who}")
        self._made.append(self.switch)
        _ip("netns", "exec", self.switch, "ip", "link", "set", "lo", "up", unavailable="cannot run a program in a namespace")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge", unavailable="cannot create a bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def _make_host(self, host: Host, port: str) -> None:
        _ip("netns", "add", host.netns, unavailable="cannot create a network namespace")
        self._made.append(host.netns)
        _ip(
            "-n", host.netns, "link", "add", host.ifname, "type", "veth", "peer", "name", port, "netns", self.switch,
            unavailable="cannot create a veth pair",
        )
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
        _ip("-n", host.netns, "link", "set", host.ifname, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")

    def down(self) -> None:
        """Kill every process on every host, then delete the namespaces (their veths and the bridge
        go with them). Tries everything; RuntimeError listing what could not be undone."""
        problems = []
        for netns in list(reversed(self._made)):
            host = next((h for h in self.hosts.values() if h.netns == netns), None)
            try:
                if host is not None:
                    host.kill_all()
                _ip("netns", "del", netns)
            except (RuntimeError, NetnsUnavailable) as exc:
                problems.append(str(exc))
                continue
            self._made.remove(netns)
        if problems:
            raise RuntimeError("could not tear the virtual LAN down:\n" + "\n".join(problems))


def established_peers(pid: int, port: int) -> set[str]:
    """IPv4 addresses with an established TCP connection to local ``port`` in ``pid``'s network
    namespace (/proc/PID/net/tcp and tcp6 show the namespace of that process)."""
    peers: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError):
            lines = pathlib.Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            for line in lines:
                fields = line.split()
                local, remote, state = fields[1], fields[2], fields[3]
                if state != TCP_ESTABLISHED or int(local.rsplit(":", 1)[1], 16) != port:
                    continue
                addr = _proc_addr(remote.rsplit(":", 1)[0])
                if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
                    addr = addr.ipv4_mapped
                peers.add(str(addr))
    return peers


def _proc_addr(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} prints it: 32-bit words in the machine's byte order."""
    words = [int(hex_addr[i : i + 8], 16) for i in range(0, len(hex_addr), 8)]
    return ipaddress.ip_address(b"".join(struct.pack("=I", w) for w in words))
