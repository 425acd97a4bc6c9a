"""Where rank 0's per-iteration metrics go: the console's progress table and ``metrics.jsonl``
(always), TensorBoard (``logging.tensorboard``) and Weights & Biases (``logging.wandb_project``).
The optional backends log every numeric metric as a scalar at ``step = iteration``; they are
imported only when asked for, and a missing package is a config error that says what to install.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import time
from typing import Any, Protocol

from elasticrl.config import ConfigError, NodeConfig, to_dict

log = logging.getLogger(__name__)


class MetricSink(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics (bools and nested values are left out)."""
    return {
        k: float(v) for k, v in metrics.items()
        if isinstance(v, numbers.Real) and not isinstance(v, bool)
    }


METRICS_FILE = "metrics.jsonl"


class ProgressTable:
    """One row per iteration on stdout, under a header printed once: a bar, reward, exact-match
    fraction, loss, world size, where the time went (rollout, update, coordination), the mean
    policy lag of the trained samples and how idle this node's engine and the trainer were."""

    def __init__(self, iterations: int):
        self.iterations = iterations
        self._header_shown = False

    def log(self, metrics: dict[str, Any], step: int) -> None:
        n = self.iterations
        if not self._header_shown:
            self._header_shown = True
            print(f"{'progress':<22} {'iter':>7}  {'reward':>6}  {'exact':>5}  {'loss':>8}  {'world':>5}  "
                  f"{'time':>6}  {'rollout':>7}  {'update':>6}  {'coord':>6}  {'lag':>4}  {'idle e/t':>9}  example", flush=True)
        filled = round(20 * step / n)
        coord = sum(metrics.get(k, 0.0) for k in ("t_barrier", "t_submit", "t_seal", "t_fetch", "t_eval"))
        evaluation = f"  eval {metrics['eval_reward']:.3f}" if "eval_reward" in metrics else ""
        print(
            f"[{'#' * filled}{'-' * (20 - filled)}] {step:>3}/{n:<3}  {metrics['reward_mean']:>6.3f}  "
            f"{metrics['exact_fraction']:>5.2f}  {metrics['loss']:>+8.4f}  {metrics['world_size']:>5}  "
            f"{metrics['seconds']:>5.2f}s  {metrics['t_rollout']:>6.2f}s  {metrics.get('t_update', 0.0):>5.2f}s  "
            f"{coord:>5.3f}s  {metrics.get('policy_lag_mean', 0.0):>4.1f}  {metrics.get('engine_idle_fraction', 0.0):>4.0%}/"
            f"{metrics.get('trainer_idle_fraction', 0.0):<4.0%}  {metrics['example']}{evaluation}",
            flush=True,
        )

    def close(self) -> None:
        pass


class JsonLines:
    """``<run dir>/metrics.jsonl``: every metric of every iteration, one JSON object a line (an
    iteration redone after a restart appears again; the last line of an iteration counts)."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, METRICS_FILE)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        with open(self.path, "a+b") as f:
            # A line torn by a kill mid-write stays torn, but this record starts a line of its own.
            torn = f.tell() > 0 and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n"
            f.write((("\n" if torn else "") + json.dumps({**metrics, "time_unix_s": time.time()}) + "\n").encode())

    def last_iteration(self) -> int:
        """The newest iteration on record (0 for none): a resumed run adds what its snapshot
        finished but nobody recorded."""
        if not os.path.exists(self.path):
            return 0
        with open(self.path, "rb") as f:
            lines = f.read().splitlines()
        for line in reversed(lines):
            try:
                return int(json.loads(line)["iteration"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line (killed mid-write)
        return 0

    def close(self) -> None:
        pass


# What a sink's missing package means, said at start-up (check_sinks) and, should it go missing
# since, when the sink opens.
NOT_INSTALLED = {
    "tensorboard": "logging.tensorboard: the tensorboard package is not installed; pip install tensorboard "
                   "(or set logging.tensorboard = false)",
    "wandb": "logging.wandb_project: the wandb package is not installed; pip install wandb "
             "(or leave logging.wandb_project empty)",
}


class TensorBoardSink:
    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(NOT_INSTALLED["tensorboard"]) from None
        self.writer = SummaryWriter(log_dir=log_dir)
        self.log_dir = log_dir

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for name, value in scalars(metrics).items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, cfg: NodeConfig):
        try:
            import wandb
        except ImportError:
            raise ConfigError(NOT_INSTALLED["wandb"]) from None
        self.run = wandb.init(
            project=cfg.logging.wandb_project, name=cfg.run.run_id, id=cfg.run.run_id, resume="allow",
            mode=cfg.logging.wandb_mode, dir=cfg.run.run_dir, config=to_dict(cfg),
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def check_sinks(cfg: NodeConfig) -> None:
    """``ConfigError`` if a sink the config asks for has no package here, before anything starts
    (found without importing it)."""
    import importlib.util

    for package, wanted in (("tensorboard", cfg.logging.tensorboard), ("wandb", cfg.logging.wandb_project)):
        if wanted and importlib.util.find_spec(package) is None:
            raise ConfigError(NOT_INSTALLED[package])


def open_sinks(cfg: NodeConfig) -> list[MetricSink]:
    """The optional sinks the config asks for (TensorBoard, W&B)."""
    sinks: list[MetricSink] = []
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(os.path.join(cfg.run.run_dir, "tensorboard")))
        log.info("tensorboard scalars in %s", sinks[-1].log_dir)
    if cfg.logging.wandb_project:
        sinks.append(WandbSink(cfg))
    return sinks
