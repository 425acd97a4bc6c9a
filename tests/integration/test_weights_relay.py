"""The weights relay with real processes: a real coordinator naming sources, worker processes
(``bench/weights_worker.py``) fetching and serving on, and one of them SIGKILLed or SIGSTOPped
mid-transfer while another reads behind it. The reader must finish from another source, resuming
at its offset (not from byte 0), with the blob intact."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from elasticrl.scheduler.client import SchedulerClient
from elasticrl.weights import peer as P
from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.waits]
WORKER = REPO / "bench" / "weights_worker.py"
RUN = "relay-run.rollout"
MB = 1 << 20


class Worker:
    def __init__(self, address: str, member: str, tmp, *extra: str):
        self.member = member
        self.log = tmp / f"{member}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "--address", address, "--run", RUN, "--member", member, "--progress-mb", "1", *extra],
            cwd=REPO, stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True, start_new_session=True,
        )
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.put(json.loads(line))

    def wait(self, event: str, timeout_s: float) -> dict:
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            try:
                e = self.events.get(timeout=0.1)
            except queue.Empty:
                assert self.proc.poll() is None, f"{self.member} exited: {self.log.read_text()[-2000:]}"
                continue
            if e["event"] == event:
                return e
        raise AssertionError(f"{self.member}: no {event!r} within {timeout_s}s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def relay(coordinator, tmp_path):
    """(publish, start_worker): the trainer's side in this process, serving at 16 MB/s per reader."""
    client = SchedulerClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=20)
    trainer = P.WeightPeer(rate_limit_bytes_s=16 * MB)
    workers: list[Worker] = []

    def start(member: str, *extra: str) -> Worker:
        w = Worker(coordinator.address, member, tmp_path, *extra)
        workers.append(w)
        w.wait("ready", 30)
        return w

    def publish(version: int, blob: bytes) -> P.Held:
        return P.publish(client, RUN, "trainer", trainer, version, blob)

    yield publish, start
    for w in workers:
        if w.proc.poll() is None:
            os.kill(w.proc.pid, signal.SIGCONT)
        w.kill()
    trainer.close()
    client.close()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_worker_lost_mid_transfer_leaves_its_reader_to_resume_elsewhere(relay, how):
    publish, start = relay
    blob = os.urandom(48 * MB)  # 3 s from the trainer at 16 MB/s
    a = start("a")
    held = publish(1, blob)
    a.wait("bytes", 20)  # a reads from the trainer
    b = start("b", "--stall-timeout", "1")
    first = b.wait("bytes", 20)["n"]  # b reads behind a (a has no reader yet, the trainer has one)
    assert first < len(blob)
    lost_at = time.monotonic()
    os.killpg(a.proc.pid, getattr(signal, how))
    got = b.wait("got", 60)
    assert got["version"] == 1 and got["bytes"] == len(blob) and got["sha256"] == held.digest
    sources = [tuple(s) for s in got["sources"] if s[2] > s[1]]
    assert sources[0][0] == "a" and sources[-1][0] == "trainer", sources
    # Resumed where a left off: the ranges are contiguous, nothing was read twice.
    assert sources[0][1] == 0 and all(x[2] == y[1] for x, y in zip(sources, sources[1:])) and sources[-1][2] == len(blob)
    # The rest comes from the trainer at 16 MB/s; a stopped source costs the 1 s stall timeout on top.
    assert time.monotonic() - lost_at < 30
    log = b.log.read_text()
    assert "failed at byte" in log and "asking for another" in log


def test_a_worker_that_joins_later_reads_from_a_peer_not_the_trainer(relay):
    publish, start = relay
    blob = os.urandom(8 * MB)
    a = start("a")
    held = publish(1, blob)
    assert a.wait("got", 30)["sources"][0][0] == "trainer"
    late = start("late")
    got = late.wait("got", 30)
    assert got["sha256"] == held.digest and [s[0] for s in got["sources"]] == ["a"]


def test_a_restarted_coordinator_learns_the_holders_back_from_the_workers(relay, coordinator, monkeypatch):
    """Holders live in the coordinator's memory only: after a SIGKILL and restart, a worker that
    holds the newest version says so again (every REANNOUNCE_S while it has nothing new to fetch),
    and a worker that joins then gets the version from it without the trainer publishing again."""
    publish, start = relay
    blob = os.urandom(4 * MB)
    a = start("a", "--reannounce-s", "0.5")
    held = publish(1, blob)
    a.wait("got", 30)
    coordinator.kill()
    coordinator.start()
    late = start("late")
    got = late.wait("got", 30)
    assert got["sha256"] == held.digest and [s[0] for s in got["sources"]] == ["a"]
