"""The node's config choices end to end (real coordinator, real torchrun nodes, ``elasticrl run``):
an HF checkpoint trained with the ``hf`` engine and exported; KL to a reference, RLOO, sequence
aggregation and a user's reward function by path; WebGym's split into a rollout phase and an
update phase; an FSDP2 run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.integration.test_demo import metrics, run_demo

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from elasticrl.rollout.tiny_llama import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama", hidden_size=32, num_hidden_layers=2)


def test_an_hf_checkpoint_trains_with_the_hf_engine_and_exports(tmp_path, tiny_llama):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    result = run_demo(
        out, "--nodes", "2", "--iterations", "3", "--checkpoint-every", "3", "--",
        "--model.kind=hf", f"--model.path={tiny_llama}", "--checkpoint.export_hf=hf", "--trainer.warmup_steps=2",
        "--trainer.lr=1e-2",
    )
    assert result.returncode == 0, result.stdout
    assert "engine hf" in result.stdout and f"exported the policy as an HF model directory: {out / 'hf'}" in result.stdout
    records = metrics(out)
    assert [r["policy_version"] for r in records] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in records)
    # The export is the final checkpoint's weights, loadable by transformers.
    final = load_file(str(out / "checkpoints" / "iter-000003" / "model.safetensors"))
    exported = AutoModelForCausalLM.from_pretrained(out / "hf", local_files_only=True)
    state = exported.state_dict()
    assert all(torch.equal(state[k], v) for k, v in final.items())
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True).state_dict()
    assert any(not torch.equal(base[k], v) for k, v in final.items()), "training did not change the weights"
    # Found by a user: the same model directory written another way refused the checkpoint.
    again = run_demo(out, "--nodes", "1", "--iterations", "4", "--", "--model.kind=hf", f"--model.path={tiny_llama}/.",
                     "--trainer.warmup_steps=2", "--trainer.lr=1e-2")
    assert again.returncode == 0 and "resumed from iteration 3 (checkpoint" in again.stdout, again.stdout


def test_a_bf16_engine_gets_its_published_weights_in_bf16(tmp_path):
    """engine.dtype = bfloat16: rank 0 publishes the weights in the engines' dtype (half the bytes
    to pack, send and hold), and a rollout-only worker's hf engine loads them."""
    import re

    from safetensors.torch import load_file

    from elasticrl.rollout.tiny_llama import write_tiny_llama

    model = write_tiny_llama(tmp_path / "model", hidden_size=256, num_hidden_layers=2, intermediate_size=256)
    numel = sum(v.numel() for f in model.glob("*.safetensors") for v in load_file(str(f)).values())
    out = tmp_path / "run"
    result = run_demo(out, "--nodes", "1", "--rollout-workers", "1", "--iterations", "3", "--", "--model.kind=hf",
                      f"--model.path={model}", "--engine.dtype=bfloat16", "--rollout.max_staleness=1")
    assert result.returncode == 0, result.stdout
    loaded = [float(mb) for mb in re.findall(r"loaded published weights: .* \((\d+\.\d) MB\)", (out / "logs" / "rollout-0.log").read_text())]
    assert loaded, (out / "logs" / "rollout-0.log").read_text()
    assert all(abs(mb - 2 * numel / 1e6) <= 0.1 for mb in loaded), (loaded, numel)  # fp32 would be 4 bytes each


def test_kl_rloo_sequence_loss_and_a_users_reward_file(tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def score(prompt, completion, target):\n    return 0.25 if completion[:1] == target[:1] else 0.0\n")
    out = tmp_path / "run"
    result = run_demo(
        out, "--nodes", "1", "--iterations", "3", "--checkpoint-every", "3", "--",
        "--algorithm.kl_coef=0.1", "--algorithm.advantage=rloo", "--algorithm.aggregation=sequence",
        f"--algorithm.rewards={reward_file}:score,format", "--algorithm.reward_weights=1,0",
        "--trainer.updates_per_iteration=1",
    )
    assert result.returncode == 0, result.stdout
    records = metrics(out)
    # Only the user's function counts (format has weight 0): every reward is 0 or 0.25.
    assert all(r["exact_fraction"] == 0 for r in records)
    assert all(0 <= r["reward_mean"] <= 0.25 for r in records) and any(r["reward_mean"] > 0 for r in records)
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # one step per iteration: iteration 1 is at the reference
    assert records[-1]["kl"] > 0
    assert (out / "checkpoints" / "iter-000003" / "reference.safetensors").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["algorithm"]["rewards"] == [f"{reward_file}:score", "format"]


def test_a_rollout_phase_then_an_update_phase(tmp_path):
    """rl_phase = rollout collects and seals iterations without training; a later rl_phase =
    update run trains on exactly those iterations (same coordinator state, same run id)."""
    out = tmp_path / "run"
    common = ("--nodes", "1", "--iterations", "3", "--checkpoint-every", "3", "--", "--run.run_id=phased")
    rollout = run_demo(out, *common, "--run.rl_phase=rollout")
    assert rollout.returncode == 0, rollout.stdout
    assert "checkpoint   none (run.rl_phase = rollout" in rollout.stdout
    rolled = metrics(out)
    assert [r["iteration"] for r in rolled] == [1, 2, 3] and all(r["policy_version"] == 0 for r in rolled)
    assert not (out / "checkpoints").exists()
    update = run_demo(out, *common, "--run.rl_phase=update")
    assert update.returncode == 0, update.stdout
    assert "starting over" not in update.stdout, update.stdout  # a rollout phase's iterations are not lost progress
    trained = metrics(out)[3:]
    assert [r["iteration"] for r in trained] == [1, 2, 3] and [r["policy_version"] for r in trained] == [1, 2, 3]
    # The update phase trained on the rollout phase's groups: the same rewards, iteration by iteration.
    assert [r["reward_mean"] for r in trained] == [r["reward_mean"] for r in rolled]
    # All drawn by version 0, they are corrected as off-policy samples (found by a researcher: the
    # most off-policy mode could not use the correction): from the second update on the weight moves.
    assert trained[0]["tis_weight_mean"] == pytest.approx(1.0) and trained[-1]["tis_weight_mean"] != 1.0, trained
    missing = subprocess.run(
        [sys.executable, "-m", "elasticrl.demo", "--out", str(tmp_path / "other"), "--nodes", "1", "--iterations", "1",
         "--", "--run.rl_phase=update"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert missing.returncode != 0
    assert "was never rolled out" in missing.stdout + missing.stderr + _logs(tmp_path / "other")


def _logs(run_dir) -> str:
    return "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))


def test_fsdp2_trains_through_the_node(tmp_path):
    """Under FSDP2, in micro-batches of one row: 5 groups of 8 split 24 / 16 rows between the
    ranks, so the rank with fewer runs 8 empty micro-batches to match the other's forwards and
    backwards (each gathers parameters, a collective): a count that differed would hang."""
    out = tmp_path / "run"
    result = run_demo(out, "--nodes", "2", "--iterations", "2", "--checkpoint-every", "2", "--", "--trainer.strategy=fsdp2",
                      "--task.prompts_per_iteration=5", "--trainer.micro_batch_rows=1")
    assert result.returncode == 0, result.stdout
    records = metrics(out)
    assert [r["policy_version"] for r in records] == [1, 2] and all(r["grad_norm"] > 0 for r in records)
    meta = json.loads((out / "checkpoints" / "iter-000002" / "meta.json").read_text())
    assert meta["strategy"] == "fsdp2"


def test_a_sampling_temperature_is_trained_at_the_same_temperature(tmp_path):
    """One update per iteration from the policy that sampled: the importance ratio is exactly 1
    (nothing clipped) only if the update recomputes logprobs at the engines' temperature."""
    out = tmp_path / "run"
    result = run_demo(
        out, "--nodes", "1", "--iterations", "2", "--checkpoint-every", "2", "--",
        "--rollout.temperature=0.5", "--trainer.updates_per_iteration=1", "--trainer.warmup_steps=0",
    )
    assert result.returncode == 0, result.stdout
    records = metrics(out)
    assert [r["clip_fraction"] for r in records] == [0.0, 0.0], records


def test_deepspeed_zero2_trains_through_the_node(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    result = run_demo(
        out, "--nodes", "2", "--iterations", "2", "--checkpoint-every", "2", "--",
        "--trainer.strategy=deepspeed", "--trainer.zero_stage=2",
    )
    assert result.returncode == 0, result.stdout
    records = metrics(out)
    assert [r["policy_version"] for r in records] == [1, 2] and all(r["grad_norm"] > 0 for r in records)
    meta = json.loads((out / "checkpoints" / "iter-000002" / "meta.json").read_text())
    assert meta["strategy"] == "deepspeed" and meta["data_position"]["next_iteration"] == 3


def test_a_reward_function_that_raises_stops_the_run_at_once(tmp_path):
    """User code that fails fails the same way on every node: the run must stop with the error,
    not wait out rollout.seal_timeout_s (600 s) for groups no engine can score."""
    import time

    reward_file = tmp_path / "broken_reward.py"
    reward_file.write_text("def score(prompt, completion, target):\n    raise KeyError('no such answer field')\n")
    out = tmp_path / "run"
    started = time.monotonic()
    result = run_demo(out, "--nodes", "1", "--iterations", "2", "--", f"--algorithm.rewards={reward_file}:score",
                      "--trainer.warmup_steps=0")
    assert result.returncode != 0, result.stdout
    assert time.monotonic() - started < 100
    assert "the reward function failed" in _logs(out) or "raised KeyError" in _logs(out), _logs(out)[-3000:]
    assert not (out / "metrics.jsonl").exists()
