"""``NodeConfig`` (every section of a node's config) and how it is loaded: dataclass defaults, then
a TOML file, then ``--section.key=value`` overrides."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tomllib
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from elasticrl.config.base import ConfigError, _check
from elasticrl.config.sections import (
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
from elasticrl.config.workload import EnvConfig, TaskConfig

COORDINATOR_ENV = "ELASTICRL_COORDINATOR"
# Set by the torchrun plugin in its agent (workers inherit it) from --rdzv-endpoint/--rdzv-conf,
# so the README's torchrun command needs no second copy of the address, token file or CA.
TOKEN_FILE_ENV = "ELASTICRL_TOKEN_FILE"
TLS_CA_ENV = "ELASTICRL_TLS_CA"
CHECKPOINT_HOLD_ENV = "ELASTICRL_FAULT_CHECKPOINT_HOLD_S"
"""Fault injection (the demo's ``--kill-phase checkpoint`` sets it for the node it kills): seconds a
checkpoint stays in its temporary directory before it is renamed into place, so the kill lands
while it is being written however fast the write; unset or 0 in any real run."""
IN_PLACE_ENV = "ELASTICRL_IN_PLACE"
"""Set to 1 by the torchrun plugin with ``--rdzv-conf in_place=true``: the agents leave a lost node
to their workers, which re-form their world in place (``train/reform.py``) or exit at once so
torchrun restarts them."""
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def in_place_unsupported(strategy: str, backend: str) -> str | None:
    """None where a world of trainer ranks can re-form in place (``train/reform.py``), else why not."""
    if strategy != "ddp":
        return f"trainer.strategy = {strategy} issues collectives of its own (only ddp re-forms in place)"
    if backend != "gloo":
        return f"trainer.backend = {backend}: only gloo groups can be left behind (an NCCL communicator must be aborted)"
    return None


@dataclasses.dataclass(kw_only=True)
class NodeConfig:
    """Everything ``python -m elasticrl.node`` reads; each field is a TOML section."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    coordinator: CoordinatorSection = dataclasses.field(default_factory=CoordinatorSection)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        """Checks that span sections."""
        engine, kind = self.engine.name, self.model.kind
        _check(
            engine in ("auto", "tiny") if kind == "tiny" else engine != "tiny",
            f"engine.name: {engine!r} does not serve model.kind = {kind!r}; "
            + ("the tiny model is served by engine tiny (or auto)" if kind == "tiny" else "use hf or vllm (or auto)"),
        )
        _check(
            not self.checkpoint.export_hf or kind == "hf",
            "checkpoint.export_hf: only model.kind = hf can be exported as an HF directory",
        )
        task = self.task
        _check(
            task.kind != "generated" or bool(self.env.name),
            "task.kind = generated: the rows are instance numbers for an env to build from; set env.name "
            "(e.g. --env.name=guess)",
        )
        _check(
            not task.messages_key or task.chat_template or task.kind != "dataset" or bool(self.env.name),
            f"task.messages_key: {task.messages_key!r} gives each episode chat messages, which only a chat template "
            "turns into tokens; set task.chat_template = true (an HF model), or give a text column as task.prompt_key",
        )
        _check(
            not task.chat_template or kind == "hf",
            "task.chat_template: the tiny model has no chat template; it needs model.kind = hf",
        )
        _check(
            self.trainer.warmup_steps == 0 or (task.kind == "toy" and not self.env.name),
            "trainer.warmup_steps: the supervised warm-up trains on a toy task's targets; set it to 0 for "
            f"task.kind = {task.kind}" + (f" with env.name = {self.env.name!r}" if self.env.name else ""),
        )
        _check(
            self.rollout.max_staleness == 0 or self.run.rl_phase == "both",
            f"rollout.max_staleness: {self.rollout.max_staleness} overlaps rollout with the update, which "
            f"run.rl_phase = {self.run.rl_phase} does not run together; set it to 0 (or run.rl_phase = both)",
        )

    @property
    def engine_name(self) -> str:
        """The engine ``auto`` stands for."""
        if self.engine.name != "auto":
            return self.engine.name
        return "tiny" if self.model.kind == "tiny" else "hf"

    def resolved(self, env: Mapping[str, str] = os.environ, *, require_address: bool = True) -> "NodeConfig":
        """A copy with run.run_id, run.run_dir and coordinator.address filled in from the
        environment; ``ConfigError`` if no address is known, unless ``require_address`` is False
        (printing a config needs no coordinator)."""
        run_id = self.run.run_id or env.get(RUN_ID_ENV) or "local"
        c = self.coordinator
        address = c.address or env.get(COORDINATOR_ENV, "")
        _check(
            bool(address) or not require_address,
            f"coordinator.address is not set: pass --coordinator.address=HOST:PORT or export {COORDINATOR_ENV}=HOST:PORT "
            "(start one with `elasticrl coordinator`; under torchrun --rdzv-backend=elasticrl the plugin sets it)",
        )
        run_dir = self.run.run_dir or os.path.join("runs", run_id)
        return dataclasses.replace(
            self,
            run=dataclasses.replace(self.run, run_id=run_id, run_dir=run_dir),
            coordinator=dataclasses.replace(
                c, address=address, token_file=c.token_file or env.get(TOKEN_FILE_ENV, ""), tls_ca=c.tls_ca or env.get(TLS_CA_ENV, ""),
            ),
        )


# -- loading -----------------------------------------------------------------------------------


def _sections(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(key: str, text: str, typ: Any) -> Any:
    """Turn an override's text into the field's type (lists: comma-separated, or a JSON list;
    tables: JSON)."""
    origin = typing.get_origin(typ)
    if origin is list:
        (item,) = typing.get_args(typ)
        if text.lstrip().startswith("["):  # as in the TOML file: [] or ["a", "b"]
            try:
                parts = json.loads(text)
            except json.JSONDecodeError:
                parts = None
            if not isinstance(parts, list) or any(isinstance(p, (list, dict)) or p is None for p in parts):
                raise ConfigError(f"{key}: {text!r} is not a list of values; give them separated by commas (a,b) or "
                                  "as a JSON list ('[\"a\", \"b\"]'; [] for none)")
            return [_coerce(key, str(p).lower() if isinstance(p, bool) else str(p), item) for p in parts]
        return [_coerce(key, part.strip(), item) for part in text.split(",") if part.strip()]
    if origin is dict:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: {text!r} is not a JSON object (e.g. '{{\"zero_optimization\": {{}}}}')")
        return _check_json(key, value)
    if typ is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: {text!r} is not a boolean; use true or false")
    if typ in (int, float):
        try:
            return _finite(key, typ(text))
        except ValueError:
            raise ConfigError(f"{key}: {text!r} is not {'an integer' if typ is int else 'a number'}") from None
    return text


def _finite(key: str, value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: {value!r} is not a finite number")
    return value


def _toml_line(path, exc: Exception) -> str:
    """The text of the line a TOML error points at (tomllib's message gives only its number)."""
    m = re.search(r"at line (\d+)", str(exc))
    if m is None:
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        return f": {lines[int(m.group(1)) - 1].strip()[:200]!r}"
    except (OSError, IndexError):
        return ""


def _check_json(key: str, value: Any) -> Any:
    """A table's value from TOML or JSON: what JSON can hold (config.json records it)."""
    if isinstance(value, dict):
        return {k: _check_json(f"{key}.{k}", v) for k, v in value.items()}
    if isinstance(value, list):
        return [_check_json(f"{key}[{i}]", v) for i, v in enumerate(value)]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return _finite(key, value)
    raise ConfigError(f"{key}: {value!r} is a {type(value).__name__}; a table holds strings, numbers, booleans, "
                      "arrays and tables (write a date as a string)")


def _check_type(key: str, value: Any, typ: Any) -> Any:
    """Values from TOML: ints are fine where floats are expected, nothing else is converted."""
    origin = typing.get_origin(typ)
    if origin is list:
        (item,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: {value!r} is a {type(value).__name__}, expected a list of {item.__name__}")
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: {value!r} is a {type(value).__name__}, expected a table")
        return _check_json(key, value)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{key}: {value} is beyond a float's range") from None
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: {value!r} is a {type(value).__name__}, expected {typ.__name__}")
    return _finite(key, value)


def parse_overrides(args: Sequence[str]) -> list[tuple[str, str]]:
    """``--section.key=value`` or ``--section.key value`` pairs, in order."""
    pairs: list[tuple[str, str]] = []
    it = iter(args)
    for arg in it:
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"{arg!r}: expected --section.key=value (e.g. --trainer.lr=1e-3)")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        else:
            key = arg[2:]
            value = next(it, None)
            if value is None or (value.startswith("--") and "." in value.split("=", 1)[0]):
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
            raise ConfigError(f"--config: {os.fspath(path)!r} is not valid TOML: {exc}{_toml_line(path, exc)}") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:  # a directory, not UTF-8, an int of 5000 digits
            raise ConfigError(f"--config: {os.fspath(path)!r} cannot be read as TOML: {type(exc).__name__}: {exc}") from None
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


# What may differ from node to node: where this node finds its files and its coordinator, its
# hardware and capacity, its logs. Everything else must be the same on every node of a run.
PER_NODE_SECTIONS = frozenset({"coordinator", "engine", "logging"})
PER_NODE_KEYS = frozenset({
    "run.run_dir", "run.num_threads", "model.path", "task.path", "task.eval_path", "env.kwargs", "env.episodes_in_flight",
    "env.step_timeout_s", "rollout.slots", "rollout.relay_host", "rollout.relay_port", "rollout.weights_wait_s",
    "checkpoint.dir", "checkpoint.snapshot_dir", "checkpoint.snapshot_timeout_s", "checkpoint.export_hf",
})


def run_settings(config: NodeConfig) -> dict[str, Any]:
    """The settings every node of a run must share (``section.key`` -> value, JSON-able): all but
    ``PER_NODE_SECTIONS`` and ``PER_NODE_KEYS``."""
    return {f"{section}.{key}": value for section, values in sorted(to_dict(config).items()) if section not in PER_NODE_SECTIONS
            for key, value in sorted(values.items()) if f"{section}.{key}" not in PER_NODE_KEYS}


# What a rollout-only worker must share with the trainer: what decides how it plays and scores an
# episode (the task's rows as it renders them, the env, the rewards) and the policy it loads. Not
# the trainer's own (optimizer, iterations, batch sizes): those the worker never uses.
ROLLOUT_KEYS = frozenset({
    "task.kind", "task.name", "task.num_digits", "task.prompt_key", "task.messages_key", "task.chat_template",
    "env.name", "env.max_turns", "env.max_context_tokens", "algorithm.rewards", "algorithm.reward_weights",
})


TINY_ONLY = ("d_model", "n_layers", "n_heads", "max_seq_len")


def model_identity(model: Mapping[str, Any]) -> dict[str, Any]:
    """What of a ``[model]`` table says which model it is: not ``path`` (a node's own, and a
    directory may move; a model of another shape fails the load by itself), nor the tiny policy's
    sizes under ``kind = hf``. A checkpoint and a rollout worker must match it."""
    return {k: v for k, v in model.items() if k != "path" and not (model.get("kind") == "hf" and k in TINY_ONLY)}


def rollout_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Of a node's ``run_settings``, those a rollout-only worker must share with the trainer:
    ``ROLLOUT_KEYS`` and the model's identity."""
    model = model_identity({k.removeprefix("model."): v for k, v in settings.items() if k.startswith("model.")})
    return {**{k: v for k, v in settings.items() if k in ROLLOUT_KEYS}, **{f"model.{k}": v for k, v in model.items()}}


def setting_differences(mine: Mapping[str, Any], theirs: Mapping[str, Any], limit: int = 8) -> list[str]:
    """``"trainer.lr = 0.01 here, 0.001 there"`` for each setting that differs (at most ``limit``)."""
    keys = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    out = [f"{k} = {json.dumps(mine.get(k))} here, {json.dumps(theirs.get(k))} there" for k in keys[:limit]]
    return out + ([f"and {len(keys) - limit} more"] if len(keys) > limit else [])


def write_json(config: Any, path: str | os.PathLike) -> None:
    """Write the resolved config atomically (a reader never sees half a file)."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        json.dump(to_dict(config), f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
