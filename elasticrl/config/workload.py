"""The workload's sections of a node config: what the policy is trained on (``[task]``: a toy task, a
dataset of your own, or instances an env generates) and what it acts in (``[env]``: a single-turn
prompt, or a multi-turn environment). Pure Python, validated when built, like every section."""

from __future__ import annotations

import dataclasses
from typing import Any

from elasticrl.config.base import _check

TASK_KINDS = ("toy", "dataset", "generated")
OVERLONG_PROMPTS = ("drop", "error")


@dataclasses.dataclass(kw_only=True)
class TaskConfig:
    """Where each iteration's rows (prompts, or env instances) come from."""

    kind: str = "toy"
    """toy: a built-in digit task (task.name); dataset: your own rows from task.path; generated: no
    dataset, each task's row is {"instance": N} for an env that makes its own instances (env.name)."""
    name: str = "reverse"
    """kind = toy: task name from the registry in elasticrl.rl.tasks (copy, reverse)."""
    num_digits: int = 4
    """kind = toy: digits in each prompt."""
    path: str = ""
    """kind = dataset: a local .jsonl, .parquet, or a directory written by datasets' save_to_disk
    (nothing is downloaded). Every row becomes one task; its other fields reach the reward
    functions as keyword arguments and the env as reset(options=row)."""
    prompt_key: str = "prompt"
    """kind = dataset: the row field holding the prompt text (single-turn runs)."""
    messages_key: str = ""
    """kind = dataset: the row field holding chat messages [{role, content}, ...]; when set it is
    the prompt instead of prompt_key."""
    eval_path: str = ""
    """kind = dataset: held-out rows for run.eval_interval (same format); empty: see eval_fraction."""
    eval_fraction: float = 0.0
    """kind = dataset without eval_path: the share of task.path's rows held out for evaluation
    (a seeded split, never trained on); 0 holds out nothing (then no evaluation runs)."""
    shuffle: bool = True
    """kind = dataset: visit the rows in a new seeded order every epoch (run.seed); false: file order."""
    chat_template: bool = False
    """Render prompts and observations with the tokenizer's chat template (model.kind = hf)."""
    prompts_per_iteration: int = 32
    """Rows (tasks, GRPO groups) per iteration across the whole world."""
    group_size: int = 8
    """Samples (episodes) per row: one GRPO group; advantages are normalized within a group."""
    overlong_prompts: str = "drop"
    """kind = dataset, single-turn: a row whose prompt renders to the whole context or more (no room
    to generate; every episode of it would fail) is found at start-up and left out with a warning
    (drop), or stops the run, naming the row (error)."""
    eval_prompts: int = 32
    """Held-out rows rolled out every run.eval_interval iterations (split "eval"); all of them when
    the held-out set (task.eval_path or task.eval_fraction) has fewer."""

    def __post_init__(self) -> None:
        from elasticrl.rl.tasks import TASKS  # pure Python, cheap

        _check(self.kind in TASK_KINDS, f"task.kind: {self.kind!r} must be one of {', '.join(TASK_KINDS)}")
        _check(
            self.kind != "toy" or self.name in TASKS,
            f"task.name: {self.name!r} is not a registered task; choose one of {', '.join(sorted(TASKS))}",
        )
        _check(
            self.kind != "dataset" or bool(self.path),
            "task.path: task.kind = dataset needs the data file (e.g. --task.path=data/train.jsonl)",
        )
        _check(
            bool(self.prompt_key) or bool(self.messages_key),
            "task.prompt_key: empty; name the row field holding the prompt (or set task.messages_key)",
        )
        _check(0 <= self.eval_fraction < 1, f"task.eval_fraction: {self.eval_fraction} must be in [0, 1) (e.g. 0.05)")
        _check(
            not (self.eval_path and self.eval_fraction),
            "task.eval_fraction: set either task.eval_path (a held-out file) or task.eval_fraction, not both",
        )
        _check(self.overlong_prompts in OVERLONG_PROMPTS,
               f"task.overlong_prompts: {self.overlong_prompts!r} must be one of {', '.join(OVERLONG_PROMPTS)}")
        _check(1 <= self.num_digits <= 16, f"task.num_digits: {self.num_digits} must be 1..16")
        _check(self.prompts_per_iteration >= 1, f"task.prompts_per_iteration: {self.prompts_per_iteration} must be at least 1")
        _check(
            self.group_size >= 2,
            f"task.group_size: {self.group_size} must be at least 2: a group of one has no baseline (try 8)",
        )
        _check(self.eval_prompts >= 1, f"task.eval_prompts: {self.eval_prompts} must be at least 1")


@dataclasses.dataclass(kw_only=True)
class EnvConfig:
    """The environment every episode runs in (``elasticrl.env``); empty name: one turn on the row's prompt."""

    name: str = ""
    """"": single turn, the row's prompt scored by algorithm.rewards; a registered env (guess, web,
    search); or your class as "package.module:Class" or "path/to/file.py:Class" with
    reset(seed=None, options=None) -> (obs, info) and step(action) -> (obs, reward, terminated,
    truncated, info), sync or async."""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the env's constructor (a TOML table, or JSON on the command line)."""
    max_turns: int = 8
    """Most policy turns per episode; an episode still running after them ends as truncated."""
    step_timeout_s: float = 60.0
    """Deadline of one env reset or step, seconds; past it the episode fails (its group is retried once)."""
    episodes_in_flight: int = 128
    """Most episodes one engine plays at once (each holds an env instance)."""
    max_context_tokens: int = 0
    """Most tokens of one episode (observations and actions); 0: the model's context length.
    An episode that reaches it ends as truncated."""

    def __post_init__(self) -> None:
        _check(self.max_turns >= 1, f"env.max_turns: {self.max_turns} must be at least 1")
        _check(self.step_timeout_s > 0, f"env.step_timeout_s: {self.step_timeout_s} must be > 0 seconds")
        _check(self.episodes_in_flight >= 1, f"env.episodes_in_flight: {self.episodes_in_flight} must be at least 1")
        _check(self.max_context_tokens >= 0, f"env.max_context_tokens: {self.max_context_tokens} must be >= 0 (0: the model's)")
