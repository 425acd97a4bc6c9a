"""``elasticrl rollout`` end to end: rollout-only workers join a running run, draw groups with the
weights the trainer publishes (through the relay: the second worker gets them from the first, a
peer), and leave (one SIGKILLed, one at the end) without the trainer restarting or missing an
iteration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, wait_until
from tests.integration.test_demo import processes_mentioning

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

BUNDLED = str(REPO / "elasticrl" / "configs" / "demo.toml")


def start(cmd: list[str], log_path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def reported(out) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_rollout_only_workers_join_and_leave_a_running_run(tmp_path):
    from elasticrl.scheduler.client import SchedulerClient

    out = tmp_path / "run"
    iterations = 45
    trainer = start(
        [sys.executable, "-m", "elasticrl.demo", "--nodes", "1", "--iterations", str(iterations), "--out", str(out),
         "--lease-ttl", "2", "--", "--rollout.slots=2", "--run.eval_interval=0"],
        tmp_path / "demo.log",
    )
    workers: list[subprocess.Popen] = []
    try:
        port = wait_until(lambda: (out / "coordinator.port").exists() and (out / "coordinator.port").read_text().strip(),
                          60, message="the coordinator's port file")
        address = f"127.0.0.1:{port}"
        run_id = wait_until(lambda: (out / "config.json").exists() and json.loads((out / "config.json").read_text())["run"]["run_id"],
                            90, message="the trainer's config.json")

        def rollout_worker(name: str) -> subprocess.Popen:
            proc = start(
                [sys.executable, "-m", "elasticrl.cli", "rollout", "--coordinator", address, "--config", BUNDLED,
                 "--run-id", run_id, "--member-id", name, "--slots", "4", f"--run.run_dir={out}"],
                tmp_path / f"{name}.log",
            )
            workers.append(proc)
            return proc

        client = SchedulerClient(address, call_timeout_s=5)

        def groups_by(name: str) -> int:
            status = client.iteration_status(f"{run_id}.rollout")
            return sum(n["done"] for n in (status or {}).get("nodes", []) if n["node"] == name)

        first = rollout_worker("rollout-a")
        wait_until(lambda: groups_by("rollout-a") > 0 or trainer.poll() is not None, 90, message="rollout-a drawing groups")
        assert trainer.poll() is None, (tmp_path / "demo.log").read_text()
        second = rollout_worker("rollout-b")  # joins mid-run: its first weights come from rollout-a
        wait_until(lambda: groups_by("rollout-b") > 0 or second.poll() is not None, 90, message="rollout-b drawing groups")
        # A worker given a run id the coordinator does not have waits, but says so (found by an operator:
        # a mistyped --run-id waited in silence).
        stray = start([sys.executable, "-m", "elasticrl.cli", "rollout", "--coordinator", address, "--config", BUNDLED,
                       "--run-id", "nope", "--member-id", "stray", f"--run.run_dir={tmp_path / 'stray'}"], tmp_path / "stray.log")
        workers.append(stray)
        wait_until(lambda: "has no run 'nope'" in (tmp_path / "stray.log").read_text() or stray.poll() is not None, 90,
                   message="the stray worker's word on its run id")
        os.killpg(stray.pid, signal.SIGTERM)
        assert stray.wait(timeout=30) == 0, (tmp_path / "stray.log").read_text()
        assert f"(runs there: {run_id}); check --run-id" in (tmp_path / "stray.log").read_text()
        # Found by a researcher: a worker with another reward was taken, and its rewards trained on.
        odd = start([sys.executable, "-m", "elasticrl.cli", "rollout", "--coordinator", address, "--config", BUNDLED,
                     "--run-id", run_id, "--member-id", "odd", f"--run.run_dir={tmp_path / 'odd'}",
                     "--algorithm.rewards=exact_match", "--task.name=copy", "--trainer.lr=0.5"], tmp_path / "odd.log")
        workers.append(odd)
        assert odd.wait(timeout=120) == 2, (tmp_path / "odd.log").read_text()
        odd_log = (tmp_path / "odd.log").read_text()
        assert f"this rollout worker's config differs from the trainer's of run {run_id!r}: " in odd_log, odd_log
        assert "algorithm.rewards" in odd_log and "task.name = \"copy\" here" in odd_log and "trainer.lr" not in odd_log, odd_log
        killed_at = reported(out)
        os.killpg(first.pid, signal.SIGKILL)  # gone without a word: its lease lapses, its tasks go back
        first.wait(timeout=10)
        assert second.wait(timeout=180) == 0, (tmp_path / "rollout-b.log").read_text()
        assert trainer.wait(timeout=60) == 0, (tmp_path / "demo.log").read_text()
    finally:
        for proc in [trainer, *workers]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for pid in processes_mentioning(str(out)):
            os.kill(pid, signal.SIGKILL)

    b_log = (tmp_path / "rollout-b.log").read_text()
    assert "is closed (training finished)" in b_log and "has no run" not in b_log, b_log
    loads = [line for line in b_log.splitlines() if "elasticrl.weights.transfer" in line and "MB from" in line]
    assert loads and "from rollout-a [0," in loads[0], loads[:3]  # a peer, not the trainer
    assert any("from rank-0" in line for line in loads[1:]), loads  # after rollout-a died: the trainer
    demo_log = (tmp_path / "demo.log").read_text()
    assert "resumed from iteration" not in demo_log, "the trainer restarted for a rollout worker"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, iterations + 1))
    assert {r["world_size"] for r in records} == {1}
    helped = {name: [r["iteration"] for r in records if r["rollout_nodes"].get(name)] for name in ("rollout-a", "rollout-b")}
    assert helped["rollout-a"] and helped["rollout-b"], helped
    assert killed_at <= max(helped["rollout-a"]) + 2, helped

    # Every group a rollout-only worker drew names the policy version its iteration asked for:
    # it loaded the weights the trainer published after the previous iteration's update.
    from elasticrl.scheduler.store import TrajectoryStore

    store = TrajectoryStore(out / "coordinator" / "trajectories")
    for iteration in helped["rollout-b"][-3:]:
        directory = store.iteration_dir(f"{run_id}.rollout", iteration)
        groups = [g for shard in sorted(directory.glob("shard-*.safetensors"))
                  for g, _ in store.read_shard(f"{run_id}.rollout", iteration, shard.name)]
        by_b = [g for g in groups if g.node == "rollout-b"]
        assert by_b and {g.policy_version for g in by_b} == {iteration - 1}, (iteration, len(groups))
