"""Typed configuration of an RL node: one dataclass per component, TOML files, CLI overrides.

A config is a set of sections (``[run]``, ``[task]``, ``[policy]``, ...), each a
``@dataclass(kw_only=True)`` whose fields carry a docstring and units in their names. Values come
from the dataclass defaults, then a TOML file (``--config FILE``), then ``--section.key=value``
overrides, in that order; each section validates itself in ``__post_init__`` and says how to fix a
bad value. The resolved config is written as JSON into the run directory, so every run records
exactly what it ran with. Pure Python: nothing here imports torch, so ``--help`` and config errors
answer at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import typing
from collections.abc import Mapping, Sequence
from typing import Any

COORDINATOR_ENV = "ELASTICRL_COORDINATOR"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


class ConfigError(ValueError):
    """A config file or override is malformed; the message names the key and the fix."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """Where the node finds the coordinator, how long the run is, and where its files go."""

    run_id: str = ""
    """Run id; empty means $TORCHELASTIC_RUN_ID (torchrun's --rdzv-id), else "local"."""
    coordinator: str = ""
    """Coordinator HOST:PORT; empty means $ELASTICRL_COORDINATOR."""
    token_file: str = ""
    """File holding the coordinator's shared token; empty means $ELASTICRL_TOKEN if set."""
    tls_ca: str = ""
    """PEM CA bundle to verify a TLS coordinator; empty for plaintext."""
    run_dir: str = ""
    """Directory for config.json, metrics.jsonl and checkpoints; empty means runs/<run_id>."""
    iterations: int = 40
    """Number of RL iterations (rollout + update) in the whole run, counting resumed ones."""
    seed: int = 1234
    """Seed of prompts, sampling and initial weights; a run is reproducible for a given world size."""
    barrier_timeout_s: float = 60.0
    """How long an iteration barrier waits for a member before evicting it, seconds."""
    call_timeout_s: float = 10.0
    """Deadline of one coordinator call, seconds."""
    reconnect_timeout_s: float = 60.0
    """How long to retry an unreachable coordinator (e.g. while it restarts), seconds."""
    num_threads: int = 1
    """torch intra-op threads per worker; 1 keeps several workers on a small machine from fighting."""
    log_level: str = "INFO"
    """Worker log level: DEBUG, INFO, WARNING or ERROR."""

    def __post_init__(self) -> None:
        _check(self.iterations >= 1, f"run.iterations: {self.iterations} must be at least 1 (e.g. --run.iterations=30)")
        _check(self.barrier_timeout_s > 0, f"run.barrier_timeout_s: {self.barrier_timeout_s} must be > 0 seconds")
        _check(self.call_timeout_s > 0, f"run.call_timeout_s: {self.call_timeout_s} must be > 0 seconds")
        _check(self.reconnect_timeout_s >= 0, f"run.reconnect_timeout_s: {self.reconnect_timeout_s} must be >= 0 seconds")
        _check(self.num_threads >= 1, f"run.num_threads: {self.num_threads} must be at least 1")
        levels = ("DEBUG", "INFO", "WARNING", "ERROR")
        _check(self.log_level.upper() in levels, f"run.log_level: {self.log_level!r} is not one of {', '.join(levels)}")
        _check(
            not self.coordinator or ":" in self.coordinator,
            f"run.coordinator: {self.coordinator!r} must be HOST:PORT (e.g. 127.0.0.1:50051)",
        )

    def resolved(self, env: Mapping[str, str] = os.environ) -> "RunConfig":
        """A copy with run_id, coordinator and run_dir filled in from the environment."""
        run_id = self.run_id or env.get(RUN_ID_ENV) or "local"
        coordinator = self.coordinator or env.get(COORDINATOR_ENV, "")
        _check(
            bool(coordinator),
            f"run.coordinator is not set: pass --run.coordinator=HOST:PORT or export {COORDINATOR_ENV}=HOST:PORT "
            "(start one with `elasticrl coordinator`)",
        )
        run_dir = self.run_dir or os.path.join("runs", run_id)
        return dataclasses.replace(self, run_id=run_id, coordinator=coordinator, run_dir=run_dir)


@dataclasses.dataclass(kw_only=True)
class TaskConfig:
    """The toy task the policy is trained on (see ``elasticrl.rl.tasks``)."""

    name: str = "reverse"
    """Task name from the registry in elasticrl.rl.tasks (copy, reverse, ...)."""
    num_digits: int = 4
    """Digits in each prompt."""
    prompts_per_iteration: int = 32
    """Prompts per iteration across the whole world; each rank samples its share."""
    group_size: int = 8
    """Samples drawn per prompt (one GRPO group); advantages are normalized within a group."""

    def __post_init__(self) -> None:
        from elasticrl.rl.tasks import TASKS  # pure Python, cheap

        _check(self.name in TASKS, f"task.name: {self.name!r} is not a registered task; choose one of {', '.join(sorted(TASKS))}")
        _check(1 <= self.num_digits <= 16, f"task.num_digits: {self.num_digits} must be 1..16")
        _check(self.prompts_per_iteration >= 1, f"task.prompts_per_iteration: {self.prompts_per_iteration} must be at least 1")
        _check(
            self.group_size >= 2,
            f"task.group_size: {self.group_size} must be at least 2: a group of one has no baseline (try 8)",
        )


@dataclasses.dataclass(kw_only=True)
class PolicyConfig:
    """The tiny causal transformer trained from scratch (see ``elasticrl.policy.tiny``)."""

    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    max_seq_len: int = 64
    """Longest prompt + completion, tokens."""

    def __post_init__(self) -> None:
        _check(self.d_model >= 8, f"policy.d_model: {self.d_model} must be at least 8")
        _check(self.n_layers >= 1, f"policy.n_layers: {self.n_layers} must be at least 1")
        _check(
            self.n_heads >= 1 and self.d_model % self.n_heads == 0,
            f"policy.n_heads: {self.n_heads} must divide policy.d_model={self.d_model} (e.g. 4 for 64)",
        )
        _check(self.max_seq_len >= 4, f"policy.max_seq_len: {self.max_seq_len} must be at least 4 tokens")


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    """How completions are sampled, and how the coordinator's scheduler hands out the groups."""

    temperature: float = 1.0
    """Sampling temperature; 1.0 samples from the policy itself (what the loss assumes)."""
    max_new_tokens: int = 0
    """Longest completion, tokens; 0 means the task's own limit."""
    policy: str = "dynamic"
    """Scheduler policy: dynamic (engines pull; fast nodes take more) or static (fixed shares by weight)."""
    slots: int = 16
    """Tasks (GRPO groups) each node's engine runs at once: its credits with the scheduler."""
    deadline_s: float = 0.0
    """Seal an iteration this long after submitting it once min_fraction of its groups are done; 0: wait for all."""
    min_fraction: float = 1.0
    """With deadline_s: the fraction of groups an iteration needs before it may seal, in (0, 1]."""
    task_lease_s: float = 120.0
    """A task not finished this long after its assignment is handed to another engine, seconds."""
    backup_tasks: int = 0
    """Dynamic policy: backup copies of the last straggling tasks that idle engines may run."""
    seal_timeout_s: float = 600.0
    """How long the trainer waits for an iteration to seal before failing, seconds."""

    def __post_init__(self) -> None:
        _check(self.temperature > 0, f"rollout.temperature: {self.temperature} must be > 0 (use 1.0)")
        _check(self.max_new_tokens >= 0, f"rollout.max_new_tokens: {self.max_new_tokens} must be >= 0 (0: task default)")
        _check(self.policy in ("dynamic", "static"), f"rollout.policy: {self.policy!r} must be dynamic or static")
        _check(1 <= self.slots <= 4096, f"rollout.slots: {self.slots} must be in 1..4096")
        _check(self.deadline_s >= 0, f"rollout.deadline_s: {self.deadline_s} must be >= 0 (0: no deadline)")
        _check(0 < self.min_fraction <= 1, f"rollout.min_fraction: {self.min_fraction} must be in (0, 1]")
        _check(self.task_lease_s >= 0.001, f"rollout.task_lease_s: {self.task_lease_s} must be > 0 seconds")
        _check(self.backup_tasks >= 0, f"rollout.backup_tasks: {self.backup_tasks} must be >= 0")
        _check(self.seal_timeout_s > 0, f"rollout.seal_timeout_s: {self.seal_timeout_s} must be > 0 seconds")


LOSSES = ("grpo_clip", "reinforce")


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """The policy update: objective, optimizer and distributed backend."""

    loss: str = "grpo_clip"
    """grpo_clip: token-level clipped ratio objective (no KL); reinforce: plain policy gradient."""
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    updates_per_iteration: int = 4
    """Optimizer steps on each iteration's rollouts (>1 reuses them; grpo_clip keeps that stable)."""
    clip_eps: float = 0.2
    """grpo_clip: the probability ratio is clipped to [1 - clip_eps, 1 + clip_eps]."""
    grad_clip_norm: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    backend: str = "gloo"
    """torch.distributed backend: gloo (CPU) or nccl (GPU)."""

    def __post_init__(self) -> None:
        _check(self.loss in LOSSES, f"train.loss: {self.loss!r} is not one of {', '.join(LOSSES)}")
        _check(self.lr > 0, f"train.lr: {self.lr} must be > 0 (e.g. 3e-3)")
        _check(self.weight_decay >= 0, f"train.weight_decay: {self.weight_decay} must be >= 0")
        _check(self.updates_per_iteration >= 1, f"train.updates_per_iteration: {self.updates_per_iteration} must be at least 1")
        _check(0 < self.clip_eps < 1, f"train.clip_eps: {self.clip_eps} must be in (0, 1) (e.g. 0.2)")
        _check(self.grad_clip_norm >= 0, f"train.grad_clip_norm: {self.grad_clip_norm} must be >= 0 (0 disables)")
        _check(self.backend in ("gloo", "nccl"), f"train.backend: {self.backend!r} must be gloo or nccl")


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """When and where checkpoints (safetensors + JSON) are written and read back."""

    every_iterations: int = 10
    """Save after every this many iterations (and always after the last); 0 saves only at the end."""
    dir: str = ""
    """Checkpoint directory; empty means <run_dir>/checkpoints."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after a save."""
    every_node: bool = False
    """Let local rank 0 of every node save (no shared filesystem), not only global rank 0."""
    resume: bool = True
    """Continue from the newest checkpoint any rank holds, broadcast from that rank."""

    def __post_init__(self) -> None:
        _check(self.every_iterations >= 0, f"checkpoint.every_iterations: {self.every_iterations} must be >= 0")
        _check(self.keep_last >= 1, f"checkpoint.keep_last: {self.keep_last} must be at least 1")


@dataclasses.dataclass(kw_only=True)
class NodeConfig:
    """Everything ``python -m elasticrl.node`` reads; each field is a TOML section."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)


# -- loading -----------------------------------------------------------------------------------


def _sections(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(key: str, text: str, typ: Any) -> Any:
    """Turn an override's text into the field's type."""
    if typ is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: {text!r} is not a boolean; use true or false")
    if typ in (int, float):
        try:
            return typ(text)
        except ValueError:
            raise ConfigError(f"{key}: {text!r} is not {'an integer' if typ is int else 'a number'}") from None
    return text


def _check_type(key: str, value: Any, typ: Any) -> Any:
    """Values from TOML: ints are fine where floats are expected, nothing else is converted."""
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: {value!r} is a {type(value).__name__}, expected {typ.__name__}")
    return value


def parse_overrides(args: Sequence[str]) -> list[tuple[str, str]]:
    """``--section.key=value`` or ``--section.key value`` pairs, in order."""
    pairs: list[tuple[str, str]] = []
    it = iter(args)
    for arg in it:
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"{arg!r}: expected --section.key=value (e.g. --train.lr=1e-3)")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        else:
            key = arg[2:]
            value = next(it, None)
            if value is None:
                raise ConfigError(f"--{key}: missing value (write --{key}=VALUE)")
        pairs.append((key, value))
    return pairs


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[tuple[str, str]] = (),
    cls: type = NodeConfig,
) -> Any:
    """Build ``cls`` from defaults, the TOML file at ``path`` and ``overrides`` (later wins)."""
    sections = _sections(cls)
    raw: dict[str, dict[str, Any]] = {name: {} for name in sections}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"--config: {os.fspath(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--config: {os.fspath(path)!r} is not valid TOML: {exc}") from None
        for name, table in data.items():
            if name not in sections:
                raise ConfigError(f"[{name}]: unknown section; valid sections are {', '.join(sections)}")
            if not isinstance(table, dict):
                raise ConfigError(f"{name}: expected a [{name}] table, got {table!r}")
            fields = _sections(sections[name])
            for key, value in table.items():
                if key not in fields:
                    raise ConfigError(f"{name}.{key}: unknown key; [{name}] has {', '.join(fields)}")
                raw[name][key] = _check_type(f"{name}.{key}", value, fields[key])
    for dotted, text in overrides:
        name, _, key = dotted.partition(".")
        if name not in sections:
            raise ConfigError(f"--{dotted}: unknown section {name!r}; valid sections are {', '.join(sections)}")
        fields = _sections(sections[name])
        if key not in fields:
            raise ConfigError(f"--{dotted}: unknown key {key!r}; [{name}] has {', '.join(fields)}")
        raw[name][key] = _coerce(f"--{dotted}", text, fields[key])
    return cls(**{name: sections[name](**values) for name, values in raw.items()})


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def write_json(config: Any, path: str | os.PathLike) -> None:
    """Write the resolved config atomically (a reader never sees half a file)."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        json.dump(to_dict(config), f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
