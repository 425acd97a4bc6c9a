"""Optional metric sinks beside metrics.jsonl: TensorBoard (``logging.tensorboard``) and Weights &
Biases (``logging.wandb_project``). Rank 0 logs every numeric metric of an iteration as a scalar at
``step = iteration``; both backends are imported only when asked for, and a missing package is a
config error that says what to install.
"""

from __future__ import annotations

import logging
import numbers
import os
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


class TensorBoardSink:
    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "logging.tensorboard: the tensorboard package is not installed; pip install tensorboard "
                "(or set logging.tensorboard = false)"
            ) from None
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
            raise ConfigError(
                "logging.wandb_project: the wandb package is not installed; pip install wandb "
                "(or leave logging.wandb_project empty)"
            ) from None
        self.run = wandb.init(
            project=cfg.logging.wandb_project, name=cfg.run.run_id, id=cfg.run.run_id, resume="allow",
            mode=cfg.logging.wandb_mode, dir=cfg.run.run_dir, config=to_dict(cfg),
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def open_sinks(cfg: NodeConfig) -> list[MetricSink]:
    sinks: list[MetricSink] = []
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(os.path.join(cfg.run.run_dir, "tensorboard")))
        log.info("tensorboard scalars in %s", sinks[-1].log_dir)
    if cfg.logging.wandb_project:
        sinks.append(WandbSink(cfg))
    return sinks
