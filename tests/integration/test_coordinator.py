"""A real ``elasticrl coordinator`` subprocess and real member processes, killed by pid."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from elasticrl.coordinator.client import CoordinatorClient, Membership
from elasticrl.errors import CoordinatorUnavailableError, FencedError
from tests.conftest import REPO, wait_until

pytestmark = pytest.mark.integration
MEMBER = pathlib.Path(__file__).with_name("member_proc.py")


class MemberProcess:
    """A member_proc.py subprocess whose JSON event lines are collected by a reader thread."""

    def __init__(self, address: str, run: str, member: str, *args: str):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, str(MEMBER), address, run, member, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        self.events: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                pass

    def wait_event(self, kind: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        for e in self.seen:
            if e["event"] == kind:
                return e
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                err = self.proc.stderr.read() if self.proc.poll() is not None else "(still running)"
                raise AssertionError(f"no {kind!r} event within {timeout_s}s; saw {self.seen}; stderr: {err}")
            try:
                e = self.events.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(e)
            if e["event"] == kind:
                return e

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


@pytest.fixture
def members():
    started: list[MemberProcess] = []

    def spawn(address, run, member, *args) -> MemberProcess:
        m = MemberProcess(address, run, member, *args)
        started.append(m)
        return m

    yield spawn
    for m in started:
        if m.proc.poll() is None:
            os.kill(m.proc.pid, signal.SIGCONT)
            m.kill()
        m.proc.wait(timeout=10)


def member_state(client, run: str, member: str) -> str | None:
    data = client.status(run, include_departed=True)
    for r in data["runs"]:
        for m in r["snapshot"].get("members", []) + r.get("departed", []):
            if m["member_id"] == member:
                return m["state"]
    return None


def barrier_arrivals(client, run: str, name: str) -> int:
    for r in client.status(run)["runs"]:
        for b in r.get("open_barriers", []):
            if b["name"] == name:
                return len(b.get("arrived", []))
    return 0


def test_sigkilled_member_is_evicted_and_barrier_releases_survivors(coordinator, client, members):
    ttl = coordinator.lease_ttl_s
    c = members(coordinator.address, "run1", "c")  # joins first so the barrier expects it
    c.wait_event("joined", 20)
    a = members(coordinator.address, "run1", "a", "--barrier", "iter-1/start")
    b = members(coordinator.address, "run1", "b", "--barrier", "iter-1/start")
    a.wait_event("joined", 20)
    b.wait_event("joined", 20)
    wait_until(lambda: barrier_arrivals(client, "run1", "iter-1/start") == 2, 20, message="a and b to arrive")

    killed_at = time.monotonic()
    c.kill(signal.SIGKILL)
    wait_until(lambda: member_state(client, "run1", "c") == "MEMBER_STATE_EVICTED", ttl + 5, 0.01, "c's eviction")
    evicted_after = time.monotonic() - killed_at
    assert evicted_after <= ttl + 0.5, f"evicted {evicted_after:.3f}s after SIGKILL (ttl {ttl}s)"

    for m in (a, b):
        released = m.wait_event("released", 10)
        assert released["arrived"] == ["a", "b"] and released["evicted"] == ["c"]
        assert released["t"] - killed_at <= ttl + 0.5


def test_sigstopped_member_is_fenced_when_it_resumes(coordinator, client, members):
    ttl = coordinator.lease_ttl_s
    z = members(coordinator.address, "run2", "zombie")
    joined = z.wait_event("joined", 20)
    z.kill(signal.SIGSTOP)
    wait_until(lambda: member_state(client, "run2", "zombie") == "MEMBER_STATE_EVICTED", ttl + 5, message="eviction")
    time.sleep(ttl / 2)
    z.kill(signal.SIGCONT)
    fenced = z.wait_event("fenced", 10)
    assert fenced["error"] == "FencedError" and "lease expired" in fenced["message"]
    assert z.proc.wait(timeout=10) == 4
    with pytest.raises(FencedError, match="no longer live"):
        client.keep_alive("run2", "zombie", joined["incarnation"])


def test_coordinator_sigkill_restart_mid_barrier_loses_nothing(coordinator_factory, members):
    coord = coordinator_factory(lease_ttl_s=3.0)
    client = CoordinatorClient(coord.address, call_timeout_s=5, reconnect_timeout_s=30)
    keys = {f"key/{i}".encode(): os.urandom(16) for i in range(200)}
    client.kv_set("run3", keys)
    c = Membership(client, "run3", "c")
    a = members(coord.address, "run3", "a", "--barrier", "iter-7/sync")
    b = members(coord.address, "run3", "b", "--barrier", "iter-7/sync")
    wait_until(lambda: barrier_arrivals(client, "run3", "iter-7/sync") == 2, 20, message="a and b to arrive")
    epoch_before = client.status("run3")["runs"][0]["snapshot"]["epoch"]

    coord.kill()
    coord.start()  # same port, same --state-dir
    result = c.arrive("iter-7/sync", timeout_s=30)
    assert result.arrived == ["a", "b", "c"] and result.evicted == []
    for m in (a, b):
        assert m.wait_event("released", 30)["arrived"] == ["a", "b", "c"]
    assert client.kv_get("run3", list(keys)) == list(keys.values())
    snapshot = client.status("run3")["runs"][0]["snapshot"]
    assert snapshot["epoch"] == epoch_before and len(snapshot["members"]) == 3
    assert c.fenced is None and not any(e["event"] == "fenced" for m in (a, b) for e in m.seen)
    c.leave()
    client.close()


def test_sigterm_shuts_down_cleanly(coordinator):
    assert coordinator.stop() == 0
    assert "stopped" in coordinator.log()


def test_unreachable_coordinator_fails_with_address_after_bounded_retries():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = CoordinatorClient(f"127.0.0.1:{port}", call_timeout_s=1, reconnect_timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailableError, match=f"127.0.0.1:{port}"):
        client.join("r", "a")
    assert time.monotonic() - started < 6
    client.close()


def test_watch_streams_membership_events(client):
    a = Membership(client, "run4", "a")
    stop = threading.Event()
    views = queue.Queue()

    def consume():
        for view in client.watch("run4", stop=stop):
            views.put(view)

    threading.Thread(target=consume, daemon=True).start()
    first = views.get(timeout=10)
    assert first.members == ("a",)
    b = Membership(client, "run4", "b")
    b.leave("done")
    seen = []
    deadline = time.monotonic() + 10
    while ("left", "b") not in seen and time.monotonic() < deadline:
        seen += [(kind, mid) for kind, mid, _ in views.get(timeout=10).events]
    assert ("joined", "b") in seen and ("left", "b") in seen
    stop.set()
    a.leave()


def test_status_cli_table_and_json(coordinator, client):
    m = Membership(client, "run5", "node-0", weight=2.0, capabilities={"role": "agent"})
    cmd = [sys.executable, "-m", "elasticrl", "status", "--coordinator", coordinator.address]
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    info = data["runs"][0]["snapshot"]["members"][0]
    assert info["member_id"] == "node-0" and info["weight"] == 2.0 and int(info["incarnation"]) == m.incarnation
    assert 0 < int(info["lease_left_ms"]) <= 1000
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert table.returncode == 0 and "node-0" in table.stdout and "LEASE LEFT" in table.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "elasticrl", "status", "--coordinator", "127.0.0.1:1", "--timeout", "0.5"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert bad.returncode == 1 and "127.0.0.1:1" in bad.stderr and "Traceback" not in bad.stderr
    m.leave()


def test_port_in_use_and_bad_flags_fail_with_a_clear_message(coordinator, tmp_path):
    base = [sys.executable, "-m", "elasticrl", "coordinator"]
    cases = [
        (["--port", str(coordinator.port)], "could not bind"),
        (["--port", "0", "--lease-ttl", "0.01"], "lease_ttl_s"),
        (["--port", "0", "--token-file", str(tmp_path / "missing")], "token_file: cannot read"),
        (["--port", "0", "--tls-cert", "cert.pem"], "tls_cert and tls_key go together"),
        (["--port", "0", "--max-kv-value-bytes", "0"], "max_kv_value_bytes: 0 must be between 1 and"),
        # A second coordinator on a live one's state dir would write the same database.
        (["--port", "0", "--state-dir", str(coordinator.state_dir)], "the state database is locked"),
    ]
    for args, message in cases:
        out = subprocess.run(base + args, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 2, (args, out.stderr)
        assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
