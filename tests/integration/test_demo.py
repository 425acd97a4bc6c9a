"""``python -m elasticrl.demo`` end to end: a real coordinator, real torchrun agents and workers.

A short 2-node run must exit 0, log every iteration and leave a checkpoint that loads into the
policy; a second, 1-node run in the same directory must resume from it (a restarted, smaller
world continues), while a node with another policy shape must refuse it; and a run that loses a
node halfway must finish on the survivor. Each demo has
a hard timeout; afterwards no process that names the run directory may be left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

DEMO_TIMEOUT_S = 85


def run_demo(out, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "elasticrl.demo", "--out", str(out), "--lease-ttl", "2", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the demo stops everything it started
        try:
            stdout, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
        pytest.fail(f"demo did not finish within {DEMO_TIMEOUT_S}s:\n{stdout}")
    finally:
        leftovers = processes_mentioning(str(out))
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"the demo left processes behind: {leftovers}"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, "")


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (the run directory is on every one)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def metrics(out) -> list[dict]:
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def load_policy(checkpoint_dir, config_path):
    import torch
    from safetensors.torch import load_file

    from elasticrl.config import ModelConfig
    from elasticrl.policy.tiny import TinyCausalLM
    from elasticrl.policy.vocab import CharVocab

    policy = ModelConfig(**json.loads(config_path.read_text())["model"])
    model = TinyCausalLM(policy, len(CharVocab()))
    model.load_state_dict(load_file(str(checkpoint_dir / "model.safetensors")), strict=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return model


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    return out, run_demo(out, "--nodes", "2", "--iterations", "4", "--checkpoint-every", "2", "--", "--run.eval_interval=2")


def test_two_nodes_train_log_every_iteration_and_checkpoint(first_run):
    out, result = first_run
    assert result.returncode == 0, result.stdout
    assert "[####################]   4/4" in result.stdout and "done in" in result.stdout, result.stdout
    assert result.stdout.count("progress ") == 1 and "rollout" in result.stdout  # the table's header, once
    assert (out / "reward.png").stat().st_size > 1000 and f"plot         {out / 'reward.png'}" in result.stdout
    records = metrics(out)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert {r["world_size"] for r in records} == {2}
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in records)
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4]
    assert [("eval_reward" in r) for r in records] == [False, True, False, True]  # run.eval_interval=2
    assert "warm-up   10/10  supervised loss" in result.stdout, result.stdout  # the bundled config warms up

    last = out / "checkpoints" / "iter-000004"
    assert f"checkpoint   {last}" in result.stdout
    assert sorted(os.listdir(out / "checkpoints")) == ["iter-000002", "iter-000004"]
    meta = json.loads((last / "meta.json").read_text())
    assert meta["iteration"] == 4 and meta["world_size"] == 2
    load_policy(last, out / "config.json")
    assert (out / "logs" / "node-0.log").exists() and (out / "logs" / "coordinator.log").exists()


def test_a_smaller_world_resumes_from_the_newest_checkpoint(first_run):
    out, result = first_run
    assert result.returncode == 0, result.stdout
    again = run_demo(out, "--nodes", "1", "--iterations", "6", "--checkpoint-every", "2")
    assert again.returncode == 0, again.stdout
    assert "resumed from iteration 4" in again.stdout, again.stdout
    records = metrics(out)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["world_size"] for r in records[4:]] == [1, 1]
    load_policy(out / "checkpoints" / "iter-000006", out / "config.json")


def test_a_node_refuses_a_checkpoint_of_another_policy(first_run, coordinator, tmp_path):
    """``python -m elasticrl.node`` without torchrun (a world of one) against a real coordinator."""
    out, result = first_run
    assert result.returncode == 0, result.stdout
    node = subprocess.run(
        [sys.executable, "-m", "elasticrl.node", f"--coordinator.address={coordinator.address}", "--run.run_id=mismatch",
         f"--run.run_dir={tmp_path}", f"--checkpoint.dir={out / 'checkpoints'}", "--model.d_model=32"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert node.returncode == 2, node.stderr
    assert "use the same [model] or a new checkpoint.dir" in node.stderr
    assert "'d_model': 64" in node.stderr and "'d_model': 32" in node.stderr


@pytest.mark.slow
def test_losing_a_node_mid_run_finishes_on_the_survivor(tmp_path):
    out = tmp_path / "run"
    result = run_demo(out, "--nodes", "2", "--iterations", "10", "--checkpoint-every", "2", "--kill-at", "4")
    assert result.returncode == 0, result.stdout
    assert "killing node-1" in result.stdout and "resumed from iteration" in result.stdout, result.stdout
    by_iteration = {r["iteration"]: r for r in metrics(out)}  # the last record of a redone iteration wins
    assert sorted(by_iteration) == list(range(1, 11))
    assert by_iteration[1]["world_size"] == 2 and by_iteration[10]["world_size"] == 1
    assert "world size 2 -> 1" in result.stdout
    load_policy(out / "checkpoints" / "iter-000010", out / "config.json")


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("phase", ["rollout", "update"])
def test_three_nodes_lose_one_during_a_phase_and_finish_every_iteration(tmp_path, phase):
    """SIGKILL one of 3 nodes while iteration 4 rolls out (its groups must still all be done, by
    the survivors) or right after it seals (during the update): the survivors re-form, resume
    from the newest checkpoint and finish; the last checkpoint loads back."""
    global DEMO_TIMEOUT_S
    out = tmp_path / "run"
    saved, DEMO_TIMEOUT_S = DEMO_TIMEOUT_S, 170
    try:
        result = run_demo(
            out, "--nodes", "3", "--iterations", "6", "--checkpoint-every", "2", "--kill-at", "4",
            "--kill-phase", phase, "--", "--rollout.slots=2", "--task.prompts_per_iteration=24",
        )
    finally:
        DEMO_TIMEOUT_S = saved
    assert result.returncode == 0, result.stdout
    moment = "during the rollout of iteration 4" if phase == "rollout" else "right after iteration 4 sealed"
    assert f"killing node-2 (SIGKILL, agent and worker) {moment}" in result.stdout, result.stdout
    assert "resumed from iteration" in result.stdout, result.stdout
    by_iteration = {r["iteration"]: r for r in metrics(out)}
    assert sorted(by_iteration) == list(range(1, 7))
    assert by_iteration[1]["world_size"] == 3 and by_iteration[6]["world_size"] == 2
    # Iteration 4 sealed with every group, the survivors finishing what the dead node held.
    (manifest_path,) = (out / "coordinator" / "trajectories").glob("*.rollout/00000004/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    assert manifest["sealed"] and manifest["tasks_done"] == manifest["tasks_total"] == 24, manifest
    assert {n["node"] for n in manifest["nodes"]} >= {"node-0-0", "node-1-0"}
    if phase == "rollout":
        assert "node-2-0" in {n["node"] for n in manifest["nodes"]}, manifest
    load_policy(out / "checkpoints" / "iter-000006", out / "config.json")
