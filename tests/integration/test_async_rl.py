"""Asynchronous RL end to end (``rollout.max_staleness = 1``): a trainer node SIGKILLed while the
engines are ahead of it, the survivor resumed from an older checkpoint, and still no trained sample
more than k versions older than the policy it trained. Real coordinator, torchrun agents, workers
and a rollout-only worker (``python -m elasticrl.demo``); every wait has a hard timeout."""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.test_demo import metrics, run_demo

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(150)]

K = 1


def test_a_trainer_killed_while_engines_are_ahead_never_trains_on_a_sample_older_than_k(tmp_path):
    """Node-1 is SIGKILLed the moment iteration 4 seals: with k = 1 that happens while the trainer
    is still at iteration 2 or 3 (the engines, the rollout-only worker above all, are ahead of it).
    Without snapshots the survivor resumes from the checkpoint of iteration 2 (version 2), trains
    the iterations already sealed from groups the dead world drew, and the next ones from groups
    drawn partly before the kill: the bound holds relative to the version the resumed trainer
    trains from, and every sample of every iteration is either trained or counted as dropped."""
    out = tmp_path / "run"
    result = run_demo(
        out, "--nodes", "2", "--rollout-workers", "1", "--iterations", "7", "--checkpoint-every", "2",
        "--kill-at", "4", "--kill-phase", "update", "--",
        f"--rollout.max_staleness={K}", "--checkpoint.snapshots=false", "--run.eval_interval=0", "--rollout.slots=4",
        "--task.prompts_per_iteration=16", "--trainer.warmup_steps=2",
        timeout_s=140,
    )
    assert result.returncode == 0, result.stdout
    assert re.search(r"killing node-1 \(SIGKILL, agent and worker\) right after iteration 4 sealed", result.stdout), result.stdout
    # The checkpoint of iteration 2 (or, had the kill beaten its write, none): older than the dead world's policy.
    assert all(int(i) <= 2 for i in re.findall(r"resumed from iteration (\d+)", result.stdout)), result.stdout
    records = metrics(out)
    assert records[-1]["iteration"] == 7 and records[-1]["world_size"] == 1  # training finished, on the survivor
    assert any(r["world_size"] == 2 for r in records)
    for r in records:
        lags = {int(lag): n for lag, n in r["policy_lag"].items()}
        assert lags and max(lags) <= K and r["policy_lag_max"] <= K, r
        assert sum(lags.values()) + r["stale_dropped"] == 16 * 8, r  # 16 groups of 8
        # The correction's weights are reported (a researcher could not see how often tis_cap binds).
        assert 0.0 < r["tis_weight_mean"] <= 2.0 and 0.0 <= r["tis_capped_fraction"] <= 1.0, r
    assert sum(int(r["policy_lag"].get(str(K), 0)) for r in records) > 0, "no sample was ever drawn ahead"
    # The rollout-only worker drew groups in both worlds and left when training closed the run.
    log = (out / "logs" / "rollout-0.log").read_text()
    assert "is closed (training finished)" in log, log[-2000:]
    assert json.loads((out / "config.json").read_text())["rollout"]["max_staleness"] == K
