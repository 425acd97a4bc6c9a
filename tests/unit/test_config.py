"""The node's typed config: defaults, TOML + --section.key=value precedence, validation messages."""

from __future__ import annotations

import json

import pytest

from elasticrl.config import ConfigError, NodeConfig, load_config, parse_overrides, write_json


def test_defaults_are_valid_and_complete():
    cfg = load_config()
    assert isinstance(cfg, NodeConfig)
    assert cfg.task.name == "reverse" and cfg.train.loss == "grpo_clip"


def test_overrides_beat_the_file_which_beats_the_defaults(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('[train]\nlr = 1e-3\nupdates_per_iteration = 2\n[task]\nname = "copy"\ngroup_size = 4\n[checkpoint]\nevery_node = true\n')
    cfg = load_config(path, parse_overrides(["--train.lr=5e-4", "--task.group_size", "6", "--checkpoint.every_node=false"]))
    assert cfg.train.lr == 5e-4  # override
    assert cfg.train.updates_per_iteration == 2  # file
    assert cfg.task.name == "copy" and cfg.task.group_size == 6
    assert cfg.checkpoint.every_node is False
    assert cfg.policy.d_model == 64  # default


def test_toml_ints_are_accepted_for_float_fields(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text("[train]\nlr = 1\n")
    assert load_config(path).train.lr == 1.0


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--train.lr=-1"], r"train.lr: -1.0 must be > 0 \(e.g. 3e-3\)"),
        (["--task.group_size=1"], r"task.group_size: 1 must be at least 2.*try 8"),
        (["--policy.n_heads=5"], r"policy.n_heads: 5 must divide policy.d_model=64"),
        (["--task.name=sort"], r"task.name: 'sort' is not a registered task; choose one of copy, reverse"),
        (["--train.loss=ppo"], r"train.loss: 'ppo' is not one of grpo_clip, reinforce"),
        (["--run.coordinator=localhost"], r"run.coordinator: 'localhost' must be HOST:PORT"),
        (["--train.lr=fast"], r"--train.lr: 'fast' is not a number"),
        (["--checkpoint.resume=maybe"], r"'maybe' is not a boolean; use true or false"),
        (["--trian.lr=1"], r"unknown section 'trian'; valid sections are run, task"),
        (["--train.learning_rate=1"], r"unknown key 'learning_rate'; \[train\] has loss, lr"),
        (["--train.lr"], r"--train.lr: missing value"),
        (["train.lr=1"], r"expected --section.key=value"),
    ],
)
def test_bad_values_say_what_is_wrong_and_how_to_fix_it(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, parse_overrides(overrides))


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)
    bad.write_text('[train]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match="train.lr: 'fast' is a str, expected float"):
        load_config(bad)
    bad.write_text("[optimizer]\nlr = 1\n")
    with pytest.raises(ConfigError, match=r"\[optimizer\]: unknown section"):
        load_config(bad)


def test_run_section_resolves_from_the_environment():
    run = load_config().run
    resolved = run.resolved({"TORCHELASTIC_RUN_ID": "job7", "ELASTICRL_COORDINATOR": "10.0.0.1:50051"})
    assert (resolved.run_id, resolved.coordinator, resolved.run_dir) == ("job7", "10.0.0.1:50051", "runs/job7")
    explicit = load_config(None, parse_overrides(["--run.coordinator=h:1", "--run.run_id=x"])).run.resolved({})
    assert (explicit.run_id, explicit.coordinator) == ("x", "h:1")
    with pytest.raises(ConfigError, match="export ELASTICRL_COORDINATOR=HOST:PORT"):
        run.resolved({})


def test_resolved_config_is_written_as_json(tmp_path):
    cfg = load_config(None, parse_overrides(["--train.lr=0.01"]))
    write_json(cfg, tmp_path / "config.json")
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["train"]["lr"] == 0.01 and set(data) == {"run", "task", "policy", "rollout", "train", "checkpoint"}
