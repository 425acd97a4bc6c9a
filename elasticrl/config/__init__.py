"""Typed configuration of an RL node: one dataclass per component, TOML files, CLI overrides.

A config is a set of sections (``[run]``, ``[task]``, ``[env]``, ``[model]``, ...), each a
``@dataclass(kw_only=True)`` whose fields carry a docstring and units in their names. Values come
from the dataclass defaults, then a TOML file (``--config FILE``), then ``--section.key=value``
overrides, in that order; each section validates itself in ``__post_init__`` and says how to fix a
bad value, and ``NodeConfig`` checks what spans sections. The resolved config is written as JSON
into the run directory, so every run records exactly what it ran with. Pure Python: nothing here
imports torch, so ``--help`` and config errors answer at once.

Modules: ``base`` (the error), ``sections`` (the machinery: run, coordinator, model, engine,
rollout, algorithm, trainer, checkpoint, logging), ``workload`` (task and env), ``node``
(``NodeConfig`` and loading).
"""

from elasticrl.config.base import ConfigError
from elasticrl.config.node import (
    CHECKPOINT_HOLD_ENV,
    IN_PLACE_ENV,
    in_place_unsupported,
    COORDINATOR_ENV,
    RUN_ID_ENV,
    TLS_CA_ENV,
    TOKEN_FILE_ENV,
    NodeConfig,
    load_config,
    parse_overrides,
    to_dict,
    write_json,
)
from elasticrl.config.sections import (
    ADVANTAGES,
    AGGREGATIONS,
    DTYPES,
    ENGINES,
    LOG_LEVELS,
    LOSSES,
    MODEL_KINDS,
    RL_PHASES,
    STRATEGIES,
    AlgorithmConfig,
    CheckpointConfig,
    CoordinatorSection,
    EngineConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)
from elasticrl.config.workload import TASK_KINDS, EnvConfig, TaskConfig

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "CHECKPOINT_HOLD_ENV", "COORDINATOR_ENV", "DTYPES", "ENGINES", "IN_PLACE_ENV", "in_place_unsupported", "LOG_LEVELS", "LOSSES", "MODEL_KINDS",
    "RL_PHASES", "RUN_ID_ENV", "STRATEGIES", "TASK_KINDS", "TLS_CA_ENV", "TOKEN_FILE_ENV", "AlgorithmConfig",
    "CheckpointConfig", "ConfigError", "CoordinatorSection", "EngineConfig", "EnvConfig", "LoggingConfig", "ModelConfig",
    "NodeConfig", "RolloutConfig", "RunConfig", "TaskConfig", "TrainerConfig", "load_config", "parse_overrides", "to_dict",
    "write_json",
]
