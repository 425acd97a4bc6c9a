"""The optional metric sinks: TensorBoard scalars read back from the event file; a missing
package is a config error that says what to install."""

from __future__ import annotations

import sys

import pytest

from elasticrl.config import ConfigError, load_config, parse_overrides
from elasticrl.train.metric_sinks import TensorBoardSink, open_sinks, scalars


def test_only_numbers_are_scalars():
    assert scalars({"a": 1, "b": 0.5, "c": True, "d": "x", "e": {"n": 1}}) == {"a": 1.0, "b": 0.5}


def test_tensorboard_sink_writes_every_numeric_metric(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is in the test extra; pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, parse_overrides(["--logging.tensorboard=true", f"--run.run_dir={tmp_path}"]))
    (sink,) = open_sinks(cfg)
    assert isinstance(sink, TensorBoardSink)
    for step in (1, 2, 3):
        sink.log({"reward_mean": step / 10, "example": "12=21", "iteration": step}, step=step)
    sink.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward_mean", "iteration"}
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward_mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_a_missing_wandb_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = load_config(None, parse_overrides(["--logging.wandb_project=p", f"--run.run_dir={tmp_path}"]))
    with pytest.raises(ConfigError, match="pip install wandb"):
        open_sinks(cfg)
