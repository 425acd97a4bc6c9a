"""What a run trains on, from its ``[task]`` and ``[env]`` sections: the rows of each iteration, and
the environment every episode of a row is played in.

Rows (the driver, rank 0, turns each into one scheduler task = one GRPO group):

* ``ToyRows``: a built-in digit task's ``{"prompt", "target"}`` rows, drawn from (seed, iteration).
* ``DatasetRows``: your rows from ``task.path``, in a per-epoch shuffled order; iteration ``i``
  takes the next ``prompts_per_iteration`` of them. Where the data stands is a row *position*
  saved in every checkpoint, so a resumed run neither repeats nor skips rows.
* ``GeneratedRows``: ``{"instance": N}`` rows for an env that builds its own instances.

Every source also has fixed held-out rows for evaluation. Episodes (every engine builds the same
``EnvSpec``): ``env.name`` when set, otherwise ``PromptEnv``, one turn on the row's prompt scored
by the reward functions. Pure Python: the driver and the engines both import this.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import pathlib
import random
from typing import Any, Protocol

from elasticrl.config import ConfigError, NodeConfig
from elasticrl.env import EnvLoadError, EnvSpec, load_env
from elasticrl.env.prompt import PromptEnv
from elasticrl.rl.rewards import RewardFunction
from elasticrl.rl.tasks import Task, make_task
from elasticrl.rollout.hf_dir import check_model_files, has_chat_template, model_positions

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 256
"""Longest action (one turn) when rollout.max_new_tokens is 0 and the task is not a toy task."""


class RowSource(Protocol):
    def train_rows(self, iteration: int, count: int) -> list[dict[str, Any]]:
        """The rows iteration ``iteration`` (1-based) trains on: the same for the same run every time."""
        ...

    def eval_rows(self, count: int) -> list[dict[str, Any]]:
        """Held-out rows, the same at every evaluation; empty when the source has none."""
        ...

    def position(self, iteration: int) -> dict[str, Any]:
        """Where the data stands once ``iteration`` is done (saved in its checkpoint)."""
        ...

    def resume(self, iteration: int, position: dict[str, Any]) -> None:
        """Continue after checkpoint ``iteration`` whose ``position()`` was ``position``."""
        ...


class ToyRows:
    """A toy task's rows: prompts drawn from ``random.Random(f"{seed}/{iteration}")``, so every
    world size trains on the same data and the iteration number is the data position."""

    def __init__(self, task: Task, seed: int):
        self.task = task
        self.seed = seed

    def train_rows(self, iteration: int, count: int) -> list[dict[str, Any]]:
        return [{"prompt": e.prompt, "target": e.target} for e in self.task.sample(random.Random(f"{self.seed}/{iteration}"), count)]

    def eval_rows(self, count: int) -> list[dict[str, Any]]:
        return [{"prompt": e.prompt, "target": e.target} for e in self.task.sample(random.Random(f"{self.seed}/eval"), count)]

    def position(self, iteration: int) -> dict[str, Any]:
        return {"next_iteration": iteration + 1, "prompt_rng": f"{self.seed}/{iteration + 1}"}

    def resume(self, iteration: int, position: dict[str, Any]) -> None:
        pass


def _instance(seed: int, tag: str, k: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{tag}/{k}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "little")


class GeneratedRows:
    """``{"instance": N}`` rows, N a hash of (seed, iteration, index): the env draws the instance
    from N, and every episode of a group (one row) plays the same instance."""

    def __init__(self, seed: int):
        self.seed = seed

    def train_rows(self, iteration: int, count: int) -> list[dict[str, Any]]:
        return [{"instance": _instance(self.seed, str(iteration), k)} for k in range(count)]

    def eval_rows(self, count: int) -> list[dict[str, Any]]:
        return [{"instance": _instance(self.seed, "eval", k)} for k in range(count)]

    def position(self, iteration: int) -> dict[str, Any]:
        return {"next_iteration": iteration + 1}

    def resume(self, iteration: int, position: dict[str, Any]) -> None:
        pass


class DatasetRows:
    """Rows of a dataset file, ``per_iteration`` of them per iteration, in epochs shuffled from the
    seed. Iteration ``i`` starts at row position ``base + (i - 1 - base_iteration) * per_iteration``;
    ``resume`` moves the base to what a checkpoint recorded, so changing prompts_per_iteration
    between a run and its resume still neither repeats nor skips rows."""

    def __init__(self, train: list[dict[str, Any]], held_out: list[dict[str, Any]], *, seed: int, per_iteration: int,
                 shuffle: bool = True):
        from elasticrl.data import RowStream

        self.train, self.seed, self.shuffle = train, seed, shuffle
        self.stream = RowStream(train, seed, shuffle=shuffle)
        self.held_out = held_out
        self.per_iteration = per_iteration
        self.base_iteration = 0
        self.base_position = 0
        self.checked = False
        """Whether the prompts were checked against the context (``rl.overlong``), once per process."""

    def drop(self, train: set[int], held_out: set[int]) -> None:
        """Leave out the rows of these indices (of ``train`` and of ``held_out``): the epochs are
        shuffled over the rows that stay. Before the first iteration only."""
        from elasticrl.data import RowStream

        if train:
            self.train = [row for i, row in enumerate(self.train) if i not in train]
            self.stream = RowStream(self.train, self.seed, shuffle=self.shuffle)
        if held_out:
            self.held_out = [row for i, row in enumerate(self.held_out) if i not in held_out]

    def _start(self, iteration: int) -> int:
        if iteration <= self.base_iteration:
            # Before the resume point, and no resume since: the world started over (a re-form in
            # place that found no checkpoint reuses this object), so it counts from row 0 again.
            return (iteration - 1) * self.per_iteration
        return self.base_position + (iteration - 1 - self.base_iteration) * self.per_iteration

    def train_rows(self, iteration: int, count: int) -> list[dict[str, Any]]:
        return [row for _, row in self.stream.take(self._start(iteration), count)]

    def eval_rows(self, count: int) -> list[dict[str, Any]]:
        return self.held_out[:count]

    def position(self, iteration: int) -> dict[str, Any]:
        nxt = self._start(iteration + 1)
        return {"next_iteration": iteration + 1, "next_row": nxt, "epoch": self.stream.epoch_of(nxt), "rows_per_epoch": len(self.stream)}

    def resume(self, iteration: int, position: dict[str, Any]) -> None:
        if "next_row" in position:
            self.base_iteration, self.base_position = iteration, int(position["next_row"])
        saved = position.get("rows_per_epoch")
        if saved is not None and int(saved) != len(self.stream):
            log.warning(
                "data: the checkpoint was taken with %d training rows per epoch and this run has %d (another file, or "
                "other rows left out by task.overlong_prompts: another model, context or template); the position "
                "goes on, but this epoch's order is another, so rows of it may repeat or be skipped", int(saved),
                len(self.stream))
        log.info("data: resuming after iteration %d at row position %d (epoch %d of %d rows)", iteration,
                 self._start(iteration + 1), self.stream.epoch_of(self._start(iteration + 1)), len(self.stream))


def load_dataset_rows(cfg: NodeConfig, reward: RewardFunction | None) -> DatasetRows:
    """``task.path`` (and ``task.eval_path``) read and checked, for the driver.

    Raises:
        ConfigError: a bad file or row (naming the file, the row and the key), or a reward
            function that needs a field the rows lack.
    """
    from elasticrl.data import DatasetError, load_rows, split_eval

    t = cfg.task
    single_turn = not cfg.env.name
    keys = dict(prompt_key="" if t.messages_key else t.prompt_key, messages_key=t.messages_key) if single_turn else {}
    if single_turn and not t.messages_key and cfg.model.kind == "tiny":
        from elasticrl.policy.vocab import CHARS

        keys["alphabet"] = CHARS  # a prompt the tiny policy cannot tokenize would fail every episode of it
    try:
        rows = load_rows(t.path, what="task.path", **keys)
        held_out = load_rows(t.eval_path, what="task.eval_path", **keys) if t.eval_path else []
        if t.eval_fraction:
            rows, held_out = split_eval(rows, t.eval_fraction, cfg.run.seed)
    except DatasetError as exc:
        raise ConfigError(str(exc)) from None
    if reward is not None:  # the held-out rows too: an evaluation must not stop the run hours in
        for where, some in ((t.path, rows), (t.eval_path, held_out if t.eval_path else [])):
            if some:
                _check_reward_fields(reward, list(some[0]), where)  # every column (load_rows gives each row all of them)
    if cfg.run.eval_interval and not held_out:
        log.warning("run.eval_interval = %d but the dataset has no held-out rows (task.eval_path or task.eval_fraction): "
                    "no evaluation will run", cfg.run.eval_interval)
    return DatasetRows(rows, held_out, seed=cfg.run.seed, per_iteration=t.prompts_per_iteration, shuffle=t.shuffle)


def _check_reward_fields(reward: RewardFunction, fields: list[str], where: str) -> None:
    try:
        reward.check_fields(fields, where)
    except ValueError as exc:
        raise ConfigError(f"algorithm.rewards: {exc}") from None


def workload_name(cfg: NodeConfig) -> str:
    """A few words for logs: "toy task reverse", "dataset data/train.jsonl, env guess"."""
    t = cfg.task
    rows = {"toy": f"toy task {t.name}", "dataset": f"dataset {t.path}", "generated": "generated rows"}[t.kind]
    return f"{rows}, env {cfg.env.name}" if cfg.env.name else rows


def toy_task(cfg: NodeConfig) -> Task | None:
    return make_task(cfg.task.name, cfg.task.num_digits) if cfg.task.kind == "toy" else None


def row_source(cfg: NodeConfig, reward: RewardFunction | None) -> RowSource:
    kind = cfg.task.kind
    if kind == "toy":
        if reward is not None:
            _check_reward_fields(reward, ["prompt", "target"], "task.kind = toy")
        return ToyRows(make_task(cfg.task.name, cfg.task.num_digits), cfg.run.seed)
    if kind == "dataset":
        return load_dataset_rows(cfg, reward)
    if reward is not None:
        _check_reward_fields(reward, ["instance"], "task.kind = generated (each row is {\"instance\": N})")
    return GeneratedRows(cfg.run.seed)


def episode_env(cfg: NodeConfig, reward: RewardFunction | None) -> tuple[EnvSpec, RewardFunction | None]:
    """The env of every episode and the reward over a finished transcript (None: the env's step
    rewards are the whole return).

    Raises:
        ConfigError: env.name cannot be loaded, or a single-turn run has no reward to score with.
    """
    if cfg.env.name:
        try:
            return load_env(cfg.env.name, cfg.env.kwargs), reward
        except EnvLoadError as exc:
            raise ConfigError(f"env.name: {exc}") from None
    if reward is None:
        raise ConfigError(
            "algorithm.rewards: a single-turn run on a dataset scores each completion with your reward functions; set "
            "algorithm.rewards (e.g. [\"exact_match\"], or \"my_rewards.py:score\" reading your columns as keyword "
            "arguments), or give an env (env.name)"
        )
    t = cfg.task
    factory = functools.partial(PromptEnv, score=reward.score, prompt_key=t.prompt_key, messages_key=t.messages_key)
    return EnvSpec(name="prompt", factory=factory), None


def check_model(cfg: NodeConfig) -> None:
    """``model.kind = hf``: the directory holds what a run loads (config.json, safetensors weights,
    a tokenizer) and, with ``task.chat_template``, a chat template. File checks, no import, so the
    launcher runs them before anything starts and a node before it loads the model; ConfigError
    names the key. A ``rollout.max_new_tokens`` past the model's positions is warned about: every
    completion would be cut at the context."""
    if cfg.model.kind != "hf":
        return
    try:
        path = check_model_files(cfg.model.path)
    except FileNotFoundError as exc:
        raise ConfigError(f"model.path: {exc}") from None
    if cfg.task.chat_template and not has_chat_template(path):
        raise ConfigError(
            f"task.chat_template = true: the tokenizer in model.path = {cfg.model.path!r} has no chat template (neither "
            "tokenizer_config.json nor a chat_template.jinja has one); use a chat/instruct checkpoint or set it to false")
    positions = model_positions(path)
    if positions and cfg.rollout.max_new_tokens >= positions:
        log.warning("rollout.max_new_tokens = %d, and the model in %s has %d positions: every completion is cut at the "
                    "context (the prompt's tokens included)", cfg.rollout.max_new_tokens, cfg.model.path, positions)


def context_tokens(cfg: NodeConfig) -> int:
    """The tokens an episode may hold, as the engines will: the smaller of ``env.max_context_tokens``
    and the policy's context (the tiny policy's ``model.max_seq_len``; an HF checkpoint's positions,
    from its config.json), where set; 0 when neither is. Read from the config, so every rank
    knows it before any engine is built."""
    from elasticrl.rollout.episodes import context_limit

    model = cfg.model.max_seq_len if cfg.model.kind == "tiny" else model_positions(pathlib.Path(cfg.model.path))
    return context_limit(cfg.env.max_context_tokens, model)


def max_new_tokens(cfg: NodeConfig, task: Task | None) -> int:
    """Longest action (one turn), tokens."""
    if cfg.rollout.max_new_tokens:
        return cfg.rollout.max_new_tokens
    return task.max_new_tokens if task is not None else DEFAULT_MAX_NEW_TOKENS


def row_label(row: dict[str, Any], limit: int = 200) -> str:
    """A short text naming a row (the scheduler shows it as the task's prompt)."""
    for key in ("prompt", "question", "instruction", "query"):
        if isinstance(row.get(key), str) and row[key]:
            return row[key][:limit]
    return json.dumps(row, sort_keys=True, default=str)[:limit] or "{}"
