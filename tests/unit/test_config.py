"""The node's typed config: defaults, TOML + --section.key=value precedence, validation messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elasticrl.config import ConfigError, NodeConfig, load_config, parse_overrides, write_json
from tests.conftest import REPO


def test_defaults_are_valid_and_complete():
    cfg = load_config()
    assert isinstance(cfg, NodeConfig)
    assert cfg.task.name == "reverse" and cfg.algorithm.loss == "grpo_clip" and cfg.engine_name == "tiny"


def test_overrides_beat_the_file_which_beats_the_defaults(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[trainer]\nlr = 1e-3\nupdates_per_iteration = 2\n[task]\nname = "copy"\ngroup_size = 4\n[checkpoint]\nevery_node = true\n')
    cfg = load_config(path, parse_overrides(["--trainer.lr=5e-4", "--task.group_size", "6", "--checkpoint.every_node=false"]))
    assert cfg.trainer.lr == 5e-4  # override
    assert cfg.trainer.updates_per_iteration == 2  # file
    assert cfg.task.name == "copy" and cfg.task.group_size == 6
    assert cfg.checkpoint.every_node is False
    assert cfg.model.d_model == 64  # default


def test_toml_ints_are_accepted_for_float_fields(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text("[trainer]\nlr = 1\n")
    assert load_config(path).trainer.lr == 1.0


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--trainer.lr=-1"], r"trainer.lr: -1.0 must be > 0 \(e.g. 3e-3\)"),
        (["--task.group_size=1"], r"task.group_size: 1 must be at least 2.*try 8"),
        (["--model.n_heads=5"], r"model.n_heads: 5 must divide model.d_model=64"),
        (["--task.name=sort"], r"task.name: 'sort' is not a registered task; choose one of copy, reverse"),
        (["--algorithm.loss=ppo"], r"algorithm.loss: 'ppo' is not one of grpo_clip, reinforce"),
        (["--coordinator.address=localhost"], r"coordinator.address: 'localhost' must be HOST:PORT"),
        (["--trainer.lr=fast"], r"--trainer.lr: 'fast' is not a number"),
        (["--checkpoint.resume=maybe"], r"'maybe' is not a boolean; use true or false"),
        (["--trian.lr=1"], r"unknown section 'trian'; valid sections are run, coordinator, model"),
        (["--trainer.learning_rate=1"], r"unknown key 'learning_rate'; \[trainer\] has strategy, zero_stage"),
        (["--trainer.lr"], r"--trainer.lr: missing value"),
        (["trainer.lr=1"], r"expected --section.key=value"),
        (["--rollout.max_staleness=-1"], r"rollout.max_staleness: -1 must be an integer in 0..64 \(0: on-policy"),
        (["--rollout.max_staleness=1.5"], r"--rollout.max_staleness: '1.5' is not an integer"),
        (["--algorithm.off_policy_correction=vtrace"], r"algorithm.off_policy_correction: 'vtrace' is not one of tis, none"),
        (["--algorithm.tis_cap=0.5"], r"algorithm.tis_cap: 0.5 must be >= 1"),
    ],
)
def test_bad_values_say_what_is_wrong_and_how_to_fix_it(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, parse_overrides(overrides))


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)
    bad.write_text('[trainer]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match="trainer.lr: 'fast' is a str, expected float"):
        load_config(bad)
    bad.write_text("[optimizer]\nlr = 1\n")
    with pytest.raises(ConfigError, match=r"\[optimizer\]: unknown section"):
        load_config(bad)


def test_run_and_coordinator_resolve_from_the_environment():
    cfg = load_config()
    resolved = cfg.resolved({"TORCHELASTIC_RUN_ID": "job7", "ELASTICRL_COORDINATOR": "10.0.0.1:50051"})
    assert (resolved.run.run_id, resolved.coordinator.address, resolved.run.run_dir) == ("job7", "10.0.0.1:50051", "runs/job7")
    explicit = load_config(None, parse_overrides(["--coordinator.address=h:1", "--run.run_id=x"])).resolved({})
    assert (explicit.run.run_id, explicit.coordinator.address) == ("x", "h:1")
    with pytest.raises(ConfigError, match="export ELASTICRL_COORDINATOR=HOST:PORT"):
        cfg.resolved({})


def test_lists_and_tables_from_toml_and_overrides(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[algorithm]\nrewards = ["exact_match", "format"]\nreward_weights = [1, 0.5]\n'
                    '[trainer]\ndeepspeed_config = {zero_optimization = {stage3_param_persistence_threshold = 0}}\n')
    cfg = load_config(path)
    assert cfg.algorithm.rewards == ["exact_match", "format"] and cfg.algorithm.reward_weights == [1.0, 0.5]
    assert cfg.trainer.deepspeed_config == {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    cfg = load_config(path, parse_overrides(["--algorithm.rewards=positional", "--algorithm.reward_weights=2"]))
    assert cfg.algorithm.rewards == ["positional"] and cfg.algorithm.reward_weights == [2.0]
    path.write_text('[algorithm]\nrewards = "exact_match"\n')
    with pytest.raises(ConfigError, match="algorithm.rewards: 'exact_match' is a str, expected a list of str"):
        load_config(path)
    with pytest.raises(ConfigError, match="algorithm.reward_weights: 2 weights for 1 rewards"):
        load_config(None, parse_overrides(["--algorithm.rewards=format", "--algorithm.reward_weights=1,2"]))
    with pytest.raises(ConfigError, match="trainer.deepspeed_config: 'x' is not a JSON object"):
        load_config(None, parse_overrides(["--trainer.deepspeed_config=x"]))
    # A list as the TOML file writes it (found by a user: '[]' was taken as a reward's name).
    cfg = load_config(None, parse_overrides(['--algorithm.rewards=["positional", "format"]', "--algorithm.reward_weights=[1, 0.5]"]))
    assert cfg.algorithm.rewards == ["positional", "format"] and cfg.algorithm.reward_weights == [1.0, 0.5]
    assert load_config(None, parse_overrides(["--algorithm.rewards=[]"])).algorithm.rewards == []
    with pytest.raises(ConfigError, match=r"algorithm.rewards: '\[a' is not a list of values; give them separated by commas"):
        load_config(None, parse_overrides(["--algorithm.rewards=[a"]))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--model.kind=hf"], r"model.path: model.kind = hf needs the HF model directory"),
        (["--engine.name=vllm"], r"engine.name: 'vllm' does not serve model.kind = 'tiny'"),
        (["--model.kind=hf", "--model.path=m", "--engine.name=tiny"], r"engine.name: 'tiny' does not serve model.kind = 'hf'"),
        (["--checkpoint.export_hf=out"], r"checkpoint.export_hf: only model.kind = hf"),
        (["--trainer.bf16=true"], r"trainer.bf16: bf16 compute needs GPUs"),
        (["--run.rl_phase=train"], r"run.rl_phase: 'train' must be one of both, rollout, update"),
        (["--run.rl_phase=rollout", "--rollout.max_staleness=1"], r"rollout.max_staleness: 1 overlaps rollout with the update"),
    ],
)
def test_cross_section_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, parse_overrides(overrides))


def test_engine_auto_follows_the_model_kind():
    cfg = load_config(None, parse_overrides(["--model.kind=hf", "--model.path=m"]))
    assert cfg.engine_name == "hf"


def test_resolved_config_is_written_as_json(tmp_path):
    cfg = load_config(None, parse_overrides(["--trainer.lr=0.01"]))
    write_json(cfg, tmp_path / "config.json")
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["trainer"]["lr"] == 0.01 and set(data) == {
        "run", "coordinator", "model", "task", "env", "engine", "rollout", "algorithm", "trainer", "checkpoint", "logging"
    }


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICRL_")}
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_print_config_needs_no_coordinator():
    done = _cli("-m", "elasticrl.node", "--config", "elasticrl/configs/demo.toml", "--print-config", "--run.iterations=7")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["run"]["iterations"] == 7 and printed["coordinator"]["address"] == ""
    done = _cli("-m", "elasticrl.node", "--config", "elasticrl/configs/demo.toml")  # to train, it does
    assert done.returncode == 2 and "coordinator.address is not set" in done.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--slots", "-3"], "--slots: -3 must be >= 1"),
    (["--weight", "0"], "--weight: 0.0 must be a finite number > 0"),
    (["--model.kind=hf", "--model.path=/nonexistent/model"], "model.path: '/nonexistent/model' is not a directory"),
])
def test_rollout_worker_refuses_bad_input_with_status_2(args, message):
    done = _cli("-m", "elasticrl.cli", "rollout", "--config", "elasticrl/configs/demo.toml",
                "--coordinator", "127.0.0.1:9", "--run-id", "r", *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_settings_every_node_must_share_leave_out_the_per_node_ones():
    from elasticrl.config.node import PER_NODE_KEYS, run_settings, setting_differences
    from elasticrl.train.same_config import reference

    base = load_config(None, parse_overrides([]))
    mine = run_settings(base)
    assert "trainer.lr" in mine and "model.d_model" in mine and "run.iterations" in mine
    assert not any(k.startswith(("coordinator.", "engine.", "logging.")) or k in PER_NODE_KEYS for k in mine)
    # Paths, hardware and capacity may differ from node to node; a hyper-parameter may not.
    other = load_config(None, parse_overrides(["--run.run_dir=/elsewhere", "--model.d_model=128", "--rollout.slots=2",
                                               "--engine.max_batch_rows=7", "--trainer.lr=0.01", "--logging.level=debug"]))
    assert setting_differences(run_settings(other), mine) == [
        f"model.d_model = 128 here, {base.model.d_model} there", f"trainer.lr = 0.01 here, {json.dumps(base.trainer.lr)} there"]
    many = {f"k{i}": i for i in range(10)}
    assert setting_differences(many, {}, limit=3)[-1] == "and 7 more"
    # The run's settings: the most common, a tie going to the lowest rank.
    assert reference(["a", "b", "b"]) == 1 and reference(["a", "b"]) == 0 and reference(["b", "a", "a", "b"]) == 0
    # ... unless a rank holds the settings the run trained with so far: a newcomer does not win a tie
    # (or a majority) by drawing a lower rank.
    assert reference(["b", "a"], known="a") == 1 and reference(["b", "b", "a"], known="a") == 2
    assert reference(["b", "b"], known="a") == 0  # every rank started again with new settings


def test_the_launcher_refuses_an_incomplete_hf_model_directory_before_anything_starts(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    done = _cli("-m", "elasticrl.cli", "run", "elasticrl/configs/demo.toml", "--nodes", "1", "--out", str(tmp_path / "run"),
                "--", "--model.kind=hf", f"--model.path={tmp_path}")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "model.path: " in done.stderr and "no weights (*.safetensors); no tokenizer" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()  # no coordinator, no node, no run directory


def test_a_rollout_worker_shares_what_plays_and_scores_episodes_not_the_trainers_own():
    from elasticrl.config.node import rollout_settings, run_settings
    from elasticrl.train.same_config import ROLLOUT_SETTINGS_KEY, check_rollout_worker

    trainer = load_config(None, parse_overrides(["--run.run_id=demo", "--run.iterations=99", "--trainer.lr=0.5"]))
    kept = {}

    class KV:  # the coordinator's KV as the trainer left it
        def kv_get(self, run, keys):
            return [kept.get((run, k)) for k in keys]

    check_rollout_worker(trainer, KV())  # nothing kept yet (the trainer has not agreed on its settings): no check
    kept[("demo.workers", ROLLOUT_SETTINGS_KEY)] = json.dumps(rollout_settings(run_settings(trainer))).encode()
    assert "model.d_model" in rollout_settings(run_settings(trainer)) and "trainer.lr" not in rollout_settings(run_settings(trainer))
    # The trainer's own settings, and per-node ones, may differ.
    check_rollout_worker(load_config(None, parse_overrides(["--run.run_id=demo", "--task.path=/elsewhere", "--rollout.slots=3"])), KV())
    worker = load_config(None, parse_overrides(["--run.run_id=demo", "--algorithm.rewards=exact_match", "--env.max_turns=3"]))
    with pytest.raises(ConfigError, match=r"differs from the trainer's of run 'demo': algorithm.rewards = \["):
        check_rollout_worker(worker, KV())
    # Under model.kind = hf the tiny policy's sizes say nothing (found in review: they were compared).
    hf = ["--run.run_id=demo", "--model.kind=hf", "--model.path=/m"]
    kept[("demo.workers", ROLLOUT_SETTINGS_KEY)] = json.dumps(rollout_settings(run_settings(load_config(None, parse_overrides(hf))))).encode()
    check_rollout_worker(load_config(None, parse_overrides([*hf, "--model.d_model=32", "--model.path=/elsewhere"])), KV())


def test_the_launcher_refuses_a_metrics_sink_whose_package_is_missing_before_anything_starts(tmp_path):
    # Found by a researcher: a missing wandb was reported after the model was built and warmed up.
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    done = _cli("-m", "elasticrl.cli", "run", "elasticrl/configs/demo.toml", "--nodes", "1", "--out", str(tmp_path / "run"),
                "--", "--logging.wandb_project=p")
    assert done.returncode == 2 and "logging.wandb_project: the wandb package is not installed" in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()
