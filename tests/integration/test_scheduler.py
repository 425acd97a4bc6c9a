"""The rollout scheduler end to end: a real coordinator, real worker processes
(``bench/fake_rollout_worker.py``: a ``RolloutWorker`` whose engine sleeps per task and returns
deterministic tokens), killed and paused by pid."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from elasticrl.scheduler.client import SchedulerClient
from elasticrl.scheduler.state import TaskSpec
from tests.conftest import REPO, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.waits]
WORKER = REPO / "bench" / "fake_rollout_worker.py"
sys.path.insert(0, str(REPO / "bench"))
from fake_rollout_worker import fake_tokens  # noqa: E402

TOKENS = 8
SAMPLES = 2


class WorkerProc:
    def __init__(self, tmp: pathlib.Path, address: str, run: str, member: str, task_s: float, *args: str):
        self.member = member
        self.events_path = tmp / f"{member}.events.jsonl"
        self.log_path = tmp / f"{member}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER), "--coordinator", address, "--run", run, "--member", member,
                 "--task-s", str(task_s), "--tokens", str(TOKENS), "--events", str(self.events_path), *args],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(REPO)),
            )

    def events(self, kind: str) -> list[dict]:
        if not self.events_path.exists():
            return []
        lines = self.events_path.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == kind]

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@pytest.fixture
def workers(tmp_path):
    made: list[WorkerProc] = []

    def make(address: str, run: str, member: str, task_s: float, *args: str) -> WorkerProc:
        w = WorkerProc(tmp_path, address, run, member, task_s, *args)
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop()


def tasks(n: int) -> list[TaskSpec]:
    return [TaskSpec(task_id=f"t{i:03d}", prompt_ids=[1, 2, i], num_samples=SAMPLES) for i in range(n)]


def wait_members(client: SchedulerClient, run: str, n: int) -> None:
    def live():
        runs = client.status(run)["runs"]
        return runs and sum(m["state"] == "MEMBER_STATE_LIVE" for m in runs[0]["snapshot"]["members"]) >= n

    wait_until(live, 30, message=f"{n} live workers in {run}")
    time.sleep(0.3)  # their Work streams open right after the join


def fetch_all(client: SchedulerClient, run: str, iteration: int, world_size: int = 2):
    groups = []
    for rank in range(world_size):
        groups += client.fetch_shard(run, iteration, rank=rank, world_size=world_size)
    ids = [g.task_id for g in groups]
    assert len(ids) == len(set(ids)), f"duplicate groups in the sealed batch: {sorted(ids)}"
    for g in groups:  # every group is intact: the worker's deterministic tokens, one per sample
        assert len(g.samples) == SAMPLES
        for j, s in enumerate(g.samples):
            assert s.token_ids() == fake_tokens(g.task_id, j, TOKENS), (g.task_id, j)
            assert s.logprob_list() == [-0.5] * TOKENS
    return groups


@pytest.mark.parametrize("progress", [0.3, 2.0, 0], ids=["advancing", "slow-turns", "silent"])
def test_a_task_whose_engine_advances_keeps_its_lease_past_the_lease_time(coordinator, workers, progress):
    """A task running 2.4 lease times (2.5 s) on w0: with progress reported every 0.3 s, or every
    2 s (turns of 80% of the lease: the renewal goes out at once), its lease is renewed and w1,
    idle beside it, never gets a copy; without, the lease runs out and w1 runs a copy, which
    finishes first."""
    run = f"renew-{progress}"
    slow = workers(coordinator.address, run, "w0", 6.0, *(["--progress-every", str(progress)] if progress else []))
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        wait_members(client, run, 1)
        client.submit_iteration(run, 1, tasks(1), task_lease_s=2.5)
        wait_until(lambda: slow.events("start"), 20, message="w0 starting the task")
        idle = workers(coordinator.address, run, "w1", 0.05)
        manifest = client.wait_sealed(run, 1, timeout_s=30)
        assert manifest["tasks_done"] == 1, manifest
        if progress:
            assert manifest["requeued"] == 0 and idle.events("start") == [], (manifest, slow.log())
            assert [n["node"] for n in manifest["nodes"] if n["done"]] == ["w0"], manifest
        else:
            assert manifest["requeued"] == 1 and len(idle.events("done")) == 1, manifest
        fetch_all(client, run, 1)


def test_a_wait_while_progressing_outlasts_its_timeout_as_long_as_groups_finish(coordinator, workers):
    """4 tasks of 0.8 s on one single-slot worker take ~3.2 s: a plain 1.6 s wait gives up, one
    that counts from the last finished group does not; with the worker gone, it gives up 1.6 s
    after the last group, saying so."""
    from elasticrl.errors import CoordinatorTimeoutError

    run = "progressing"
    w = workers(coordinator.address, run, "w0", 0.8)
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        wait_members(client, run, 1)
        client.submit_iteration(run, 1, tasks(4))
        with pytest.raises(CoordinatorTimeoutError, match=r"did not seal within 1.6s"):
            client.wait_sealed(run, 1, timeout_s=1.6)
        client.wait_sealed(run, 1, timeout_s=30)
        started = time.monotonic()
        client.submit_iteration(run, 2, tasks(4))
        manifest = client.wait_sealed(run, 2, timeout_s=1.6, while_progressing=True)
        assert manifest["tasks_done"] == 4 and time.monotonic() - started > 1.6, manifest
        client.submit_iteration(run, 3, tasks(4))
        wait_until(lambda: w.events("done") and w.events("done")[-1]["iteration"] == 3, 20, message="a task of iteration 3 done")
        w.signal(signal.SIGSTOP)  # silent: its tasks stay running (its lease is the coordinator's default)
        try:
            with pytest.raises(CoordinatorTimeoutError, match=r"did not seal with no group finished for 1.6s: [0-2]/4 done"):
                client.wait_sealed(run, 3, timeout_s=1.6, while_progressing=True)
        finally:
            w.signal(signal.SIGCONT)


def test_sigkill_worker_mid_iteration_every_task_completes_once_on_survivors(coordinator, workers):
    run = "kill-worker"
    ws = [workers(coordinator.address, run, f"w{i}", 0.15) for i in range(3)]
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        wait_members(client, run, 3)
        client.submit_iteration(run, 1, tasks(40))
        victim = ws[1]
        wait_until(lambda: len(victim.events("done")) >= 2, 20, message="the victim finishing two tasks")
        victim.signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        manifest = client.wait_sealed(run, 1, timeout_s=60)
        assert manifest["tasks_done"] == 40, manifest
        assert manifest["seal_reason"] == "all 40 tasks done"
        groups = fetch_all(client, run, 1)
        assert sorted(g.task_id for g in groups) == [t.task_id for t in tasks(40)]
        by_node = {n["node"]: n for n in manifest["nodes"]}
        # What the victim produced before it died is kept (its acked results are in the batch).
        kept = [g for g in groups if g.node == "w1"]
        assert kept and by_node["w1"]["done"] == len(kept)
        assert sum(n["done"] for n in manifest["nodes"]) == 40
        # The task it was running when killed went back to the queue at once (stream closed).
        started = {e["task_id"] for e in victim.events("start")}
        assert started - {g.task_id for g in kept} <= {g.task_id for g in groups if g.node != "w1"}
        assert manifest["requeued"] >= len(started - {g.task_id for g in kept})

    # `elasticrl status` shows the iteration: totals and tasks per node.
    cmd = [sys.executable, "-m", "elasticrl", "status", "--coordinator", coordinator.address, "--run", run]
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
    assert "iteration 1  dynamic  sealed (all 40 tasks done)" in table, table
    assert "tasks 40/40 done" in table and "TASKS/S" in table
    assert all(f"\nw{i} " in table for i in range(3)), table
    data = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=30, check=True).stdout)
    assert data["runs"][0]["iteration"]["tasks_done"] == 40


def test_sigstop_worker_past_lease_late_results_refused_no_duplicates(coordinator, workers):
    run = "pause-worker"
    fast = workers(coordinator.address, run, "fast", 0.05)
    slow = workers(coordinator.address, run, "slow", 0.6, "--slots", "2")
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        wait_members(client, run, 2)
        client.submit_iteration(run, 1, tasks(20))
        wait_until(lambda: len(slow.events("start")) >= 2, 20, message="the slow worker starting two tasks")
        slow.signal(signal.SIGSTOP)
        paused_at = time.monotonic()
        held = {e["task_id"] for e in slow.events("start")} - {e["task_id"] for e in slow.events("done")}
        manifest = client.wait_sealed(run, 1, timeout_s=30)
        assert manifest["tasks_done"] == 20, manifest
        assert "slow" in manifest["evicted"], manifest
        assert manifest["requeued"] >= len(held)
        before = fetch_all(client, run, 1)
        assert sorted(g.task_id for g in before) == [t.task_id for t in tasks(20)]
        assert all(g.node == "fast" for g in before if g.task_id in held)
        assert time.monotonic() - paused_at > coordinator.lease_ttl_s  # it was evicted while paused

        slow.signal(signal.SIGCONT)
        status = wait_until(
            lambda: (s := client.iteration_status(run, 1)) and s["refused_fenced"] >= len(held) and s,
            20, message="the paused worker's late results being refused",
        )
        assert slow.proc.wait(timeout=20) == 3, slow.log()[-2000:]  # it learns it is fenced and exits
        assert status["tasks_done"] == 20
        after = fetch_all(client, run, 1)
        assert [(g.task_id, g.node) for g in after] == [(g.task_id, g.node) for g in before]


def test_deadline_with_min_fraction_seals_with_what_is_done(coordinator, workers):
    run = "deadline"
    fast = workers(coordinator.address, run, "fast", 0.02)
    slow = workers(coordinator.address, run, "slow", 60.0)
    with SchedulerClient(coordinator.address, call_timeout_s=5) as client:
        wait_members(client, run, 2)
        t0 = time.monotonic()
        client.submit_iteration(run, 1, tasks(20), policy="static", deadline_s=2.0, min_fraction=0.5)
        manifest = client.wait_sealed(run, 1, timeout_s=20)
        elapsed = time.monotonic() - t0
        assert manifest["seal_reason"].startswith("deadline passed with 10/20 groups"), manifest
        assert manifest["tasks_done"] == 10
        assert 1.9 <= elapsed < 6.0, elapsed
        groups = fetch_all(client, run, 1)
        assert len(groups) == 10 and {g.node for g in groups} == {"fast"}
        # The slow worker's running task was cancelled at the seal: its engine stopped early.
        wait_until(lambda: slow.events("done"), 10, message="the slow worker dropping its cancelled task")
        assert fast.proc.poll() is None and slow.proc.poll() is None


def test_coordinator_sigkill_restart_mid_iteration_loses_nothing(coordinator_factory, workers):
    coordinator = coordinator_factory(lease_ttl_s=3.0)
    run = "restart"
    for i in range(2):
        workers(coordinator.address, run, f"w{i}", 0.08)
    with SchedulerClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=30) as client:
        wait_members(client, run, 2)
        client.submit_iteration(run, 1, tasks(60))
        wait_until(lambda: client.iteration_status(run, 1)["tasks_done"] >= 20, 30, message="20 tasks done")
        coordinator.kill()
        # Everything acknowledged so far is on disk: count the shards' groups while it is down.
        from elasticrl.scheduler.store import TrajectoryStore

        store = TrajectoryStore(coordinator.state_dir / "trajectories")
        on_disk = {
            g.task_id
            for p in (coordinator.state_dir / "trajectories" / run / "00000001").glob("shard-*.safetensors")
            for g, _ in store.read_shard(run, 1, p.name)
        }
        assert len(on_disk) >= 20
        coordinator.start()
        status = client.iteration_status(run, 1)
        assert status["tasks_done"] >= 20 and not status["sealed"]
        manifest = client.wait_sealed(run, 1, timeout_s=60)
        assert manifest["tasks_done"] == 60
        groups = fetch_all(client, run, 1)
        assert sorted(g.task_id for g in groups) == [t.task_id for t in tasks(60)]
        assert on_disk <= {g.task_id for g in groups}
        assert (coordinator.state_dir / "trajectories" / run / "00000001" / "manifest.json").exists()
