"""Reward functions that score a completion, and how a run names them in its config.

A reward function is ``fn(prompt: str, completion: str, **row) -> float``: the prompt the policy
saw, the decoded completion (up to EOS), and the task's dataset row as keyword arguments (every
field but the prompt; a function takes the fields it names, or all of them with ``**kwargs``).
The older form ``fn(prompt, completion, target)`` is the same thing for rows with a ``target``
field, which the toy tasks have. A config names one by a spec string, resolved by ``load_reward``:

* a name in ``REWARDS`` (``exact_match``, ``positional``, ``format``: they read ``target``);
* ``"package.module:function"``, imported with importlib;
* ``"path/to/file.py:function"``, loaded from that file (relative to the current directory), so a
  user's reward needs no package and no install.

``combine_rewards`` builds a weighted sum of several specs (e.g. correctness plus a small format
bonus). The task's own reward is not in the registry: the training loop calls ``Task.reward`` for
that. Every loaded function is wrapped in a ``RewardFunction``, which turns an exception, a
non-number or a non-finite score into a ``RewardError`` naming the function and the prompt: a
broken reward must stop the run, never train it silently on zeros. Pure Python (no torch), so the
rollout side can score without loading a model backend.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from elasticrl.errors import ElasticRLError
from elasticrl.plugins import SPEC_FORMS, load_object
from elasticrl.rl.tasks import positional_match

RewardFn = Callable[..., float]
"""``fn(prompt, completion, **row) -> float`` (``fn(prompt, completion, target)`` is one)."""
RESERVED_FIELDS = ("prompt", "completion")
"""Row fields never passed as keyword arguments (the prompt is the first argument already)."""

_DIGITS = re.compile(r"[0-9]+")


class RewardError(ElasticRLError, ValueError):
    """A reward spec cannot be loaded, or a reward function failed on a completion; the message
    names the spec or function, and the prompt when it failed while scoring."""


def exact_match(prompt: str, completion: str, target: str) -> float:
    """1.0 when the completion is the target, ignoring surrounding whitespace; else 0.0."""
    return 1.0 if completion.strip() == target.strip() else 0.0


def positional(prompt: str, completion: str, target: str) -> float:
    """Partial credit: the fraction of positions that match (``tasks.positional_match``)."""
    return positional_match(target, completion)


def format_reward(prompt: str, completion: str, target: str) -> float:
    """1.0 when the completion has the target's shape, whether or not it is right; else 0.0.

    The shape is deliberately simple. A target of ASCII digits (the digit tasks) asks for ASCII
    digits only, as many as the target has. Any other target asks for a non-empty completion with
    no leading or trailing whitespace. Meant as a small bonus next to a correctness reward.
    """
    if _DIGITS.fullmatch(target):
        return 1.0 if _DIGITS.fullmatch(completion) and len(completion) == len(target) else 0.0
    return 1.0 if completion and completion == completion.strip() else 0.0


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "positional": positional,
    "format": format_reward,
}


def _short(text: str, limit: int = 80) -> str:
    """``repr`` of ``text``, cut to about ``limit`` characters for error messages."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """A reward function with the name it was loaded under; calling it checks what it returns."""

    name: str
    """The spec it was loaded from (``"exact_match"``, ``"my_pkg.rewards:score"``, ...)."""
    fn: RewardFn
    """The function itself, ``fn(prompt, completion, **row) -> float``."""
    takes_all: bool = dataclasses.field(init=False)
    """It has ``**kwargs``: every row field is passed."""
    named: tuple[str, ...] = dataclasses.field(init=False)
    """Row fields it takes by name (its parameters after the first two)."""
    required: tuple[str, ...] = dataclasses.field(init=False)
    """Those of ``named`` without a default: a row must have them."""
    legacy: str = dataclasses.field(init=False)
    """The third parameter of a ``fn(prompt, completion, target)``-shaped function whatever its
    name: it gets the row's ``target`` when the row has no field of its own name."""

    def __post_init__(self) -> None:
        takes_all, named, required, legacy = True, (), (), ""
        try:
            params = list(inspect.signature(self.fn).parameters.values())
        except (TypeError, ValueError):
            params = None  # no introspectable signature: pass every field
        if params is not None:
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            rest = positional[2:] + [p for p in params if p.kind is p.KEYWORD_ONLY]
            takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
            named = tuple(p.name for p in rest)
            required = tuple(p.name for p in rest if p.default is p.empty)
            if len(params) == 3 and len(positional) == 3:
                legacy = positional[2].name
        object.__setattr__(self, "takes_all", takes_all)
        object.__setattr__(self, "named", named)
        object.__setattr__(self, "required", required)
        object.__setattr__(self, "legacy", legacy)

    def _arguments(self, row: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """(keyword arguments from ``row``, required parameters the row cannot fill)."""
        fields = {k: v for k, v in row.items() if k not in RESERVED_FIELDS and (self.takes_all or k in self.named)}
        if self.legacy and self.legacy not in fields and "target" in row:
            fields[self.legacy] = row["target"]
        return fields, [f for f in self.required if f not in fields]

    def check_fields(self, fields: Iterable[str], where: str) -> None:
        """Refuse at start-up a function that needs a row field ``where`` (a file) lacks.

        Raises:
            RewardError: a required parameter is not one of ``fields``.
        """
        have = set(fields) - set(RESERVED_FIELDS)
        _, missing = self._arguments(dict.fromkeys(have))
        if missing:
            raise RewardError(
                f"reward {self.name!r} takes {', '.join(repr(m) for m in missing)}, but the rows of {where} have no such "
                f"field (they have: {', '.join(sorted(have)) or 'none'}); give it a default or add the column"
            )

    def score(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        """The score of ``completion`` for the task ``row``, as a finite float.

        Raises:
            RewardError: the function raised, needs a field the row lacks, or returned something
                that is not a finite real number.
        """
        fields, missing = self._arguments(row)
        if missing:
            raise RewardError(
                f"reward {self.name!r} takes {', '.join(repr(m) for m in missing)} but the task's row has no such field "
                f"(it has: {', '.join(sorted(row)) or 'none'}; prompt {_short(prompt)})"
            )
        try:
            value = self.fn(prompt, completion, **fields)
        except RewardError:
            raise  # a component of a combined reward already named itself
        except Exception as e:
            raise RewardError(f"reward {self.name!r} raised {type(e).__name__}: {e} (prompt {_short(prompt)})") from e
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward {self.name!r} returned {type(value).__name__} {repr(value)[:80]}, not a number "
                f"(prompt {_short(prompt)}); a reward function must return a float"
            )
        score = float(value)
        if not math.isfinite(score):
            raise RewardError(f"reward {self.name!r} returned {score}, not a finite number (prompt {_short(prompt)})")
        return score

    def __call__(self, prompt: str, completion: str, target: str = "", **row: Any) -> float:
        """``score`` with the row given as ``target`` and keyword arguments (the 3-argument form)."""
        return self.score(prompt, completion, {"target": target, **row})


def reward_names() -> list[str]:
    """Registered reward names, sorted."""
    return sorted(REWARDS)


def load_reward(spec: str) -> RewardFunction:
    """The reward function named by ``spec``: a registered name, ``"package.module:function"`` or
    ``"path/to/file.py:function"`` (a relative path is taken from the current directory).

    Raises:
        RewardError: unknown name (the message lists the registered ones), a module that cannot be
            imported (with the ImportError's text), a missing file, a missing attribute, or an
            attribute that is not a function of ``(prompt, completion, ...)``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"reward spec {spec!r} must be a non-empty string: a name ({', '.join(reward_names())}), {SPEC_FORMS}")
    if spec in REWARDS:
        return RewardFunction(spec, REWARDS[spec])
    if ":" not in spec:
        raise RewardError(
            f"reward {spec!r} is not registered; choose one of {', '.join(reward_names())}, or name a function as "
            "'package.module:function' or 'path/to/file.py:function'"
        )
    fn = load_object(spec, what="reward", error=RewardError)
    if not callable(fn):
        attr = spec.rpartition(":")[2]
        raise RewardError(f"reward {spec!r}: {attr!r} in {spec.rpartition(':')[0]!r} is a {type(fn).__name__}, not callable")
    reward = RewardFunction(spec, fn)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return reward  # some builtins have no introspectable signature; the first call will tell
    try:  # fn(prompt, completion, **row), the row's fields it names given as keywords
        signature.bind("", "", **dict.fromkeys(reward.required))
    except TypeError:
        try:
            signature.bind("", "", "")  # fn(prompt, completion, target)
        except TypeError as e:
            raise RewardError(
                f"reward {spec!r}: {spec.rpartition(':')[2]!r} cannot be called as fn(prompt, completion, target) "
                f"or fn(prompt, completion, **row): {e}"
            ) from None
    return reward


def combine_rewards(specs: Sequence[str], weights: Sequence[float] | None = None) -> RewardFunction:
    """One reward function scoring ``sum(w_i * reward_i)`` over the loaded ``specs``.

    weights: one per spec, default 1.0 each. A component that fails raises a ``RewardError`` that
    names that component, not the sum.

    Raises:
        RewardError: no specs, a weights list of another length, a non-finite weight, or any
            error of ``load_reward``.
    """
    if isinstance(specs, str) or not specs:
        raise RewardError(f"specs: {specs!r} must be a non-empty list of reward specs, e.g. ['exact_match', 'format']")
    if weights is None:
        weights = [1.0] * len(specs)
    if len(weights) != len(specs):
        raise RewardError(
            f"weights: {len(weights)} weights for {len(specs)} reward specs {list(specs)}; give one weight per spec"
        )
    for spec, w in zip(specs, weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise RewardError(f"weights: the weight of {spec!r} is {w!r}; it must be a finite number")
    parts = [(float(w), load_reward(spec)) for spec, w in zip(specs, weights)]

    def weighted_sum(prompt: str, completion: str, **row: Any) -> float:
        return sum(w * part.score(prompt, completion, row) for w, part in parts)

    # One reward of weight 1 (the common case) keeps its own name in messages.
    name = parts[0][1].name if len(parts) == 1 and parts[0][0] == 1 else " + ".join(f"{w:g}*{part.name}" for w, part in parts)
    combined = RewardFunction(name, weighted_sum)
    # The sum needs what any part needs (checked against a dataset's columns at start-up).
    object.__setattr__(combined, "required", tuple(dict.fromkeys(f for _, p in parts for f in p.required)))
    return combined


def reward_function(specs: Sequence[str], weights: Sequence[float] | None, task=None) -> RewardFunction | None:
    """The run's reward (``algorithm.rewards``): the weighted sum of ``specs``, or, when there are
    none, the toy task's own reward (``Task.reward``); None when neither exists (an env's own
    step rewards are then the whole return)."""
    if specs:
        return combine_rewards(list(specs), list(weights) if weights else None)
    if task is None:
        return None
    from elasticrl.rl.tasks import Example

    def task_reward(prompt: str, completion: str, target: str) -> float:
        return task.reward(Example(prompt=prompt, target=target), completion)

    return RewardFunction(f"task:{task.name}", task_reward)
