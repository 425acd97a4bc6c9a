"""Reward functions that score a completion, and how a run names them in its config.

A reward function is ``fn(prompt: str, completion: str, target: str) -> float``: the prompt the
policy saw, the decoded completion (up to EOS) and the example's target. A config names one by a
spec string, resolved by ``load_reward``:

* a name in ``REWARDS`` (``exact_match``, ``positional``, ``format``);
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
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from elasticrl.errors import ElasticRLError
from elasticrl.rl.tasks import positional_match

RewardFn = Callable[[str, str, str], float]
"""``fn(prompt, completion, target) -> float``."""

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
    """The function itself, ``fn(prompt, completion, target) -> float``."""

    def __call__(self, prompt: str, completion: str, target: str) -> float:
        """The score as a finite float.

        Raises:
            RewardError: the function raised, or returned something that is not a finite real number.
        """
        try:
            value = self.fn(prompt, completion, target)
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


def reward_names() -> list[str]:
    """Registered reward names, sorted."""
    return sorted(REWARDS)


def _module_from_file(spec: str, file_part: str) -> object:
    path = Path(file_part).expanduser()
    resolved = path.resolve()  # relative paths are taken from the current directory
    if not resolved.is_file():
        raise RewardError(f"reward {spec!r}: file {file_part!r} does not exist (looked at {resolved})")
    # A name derived from the full path: two reward files called rewards.py do not collide.
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    module_name = f"_elasticrl_reward_{re.sub(r'[^0-9A-Za-z_]', '_', resolved.stem)}_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"reward {spec!r}: {resolved} cannot be loaded as a Python module (does it end in .py?)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and typing resolve a class's module through sys.modules
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise RewardError(f"reward {spec!r}: running {resolved} failed with {type(e).__name__}: {e}") from e
    return module


def _module_from_import(spec: str, module_part: str) -> object:
    try:
        return importlib.import_module(module_part)
    except ImportError as e:
        raise RewardError(f"reward {spec!r}: module {module_part!r} is not importable: {e}") from e
    except Exception as e:
        raise RewardError(f"reward {spec!r}: importing module {module_part!r} failed with {type(e).__name__}: {e}") from e


def _is_file_part(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or "\\" in module_part


def load_reward(spec: str) -> RewardFunction:
    """The reward function named by ``spec``: a registered name, ``"package.module:function"`` or
    ``"path/to/file.py:function"`` (a relative path is taken from the current directory).

    Raises:
        RewardError: unknown name (the message lists the registered ones), a module that cannot be
            imported (with the ImportError's text), a missing file, a missing attribute, or an
            attribute that is not a function of ``(prompt, completion, target)``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"reward spec {spec!r} must be a non-empty string: a name ({', '.join(reward_names())}), "
                          "'package.module:function' or 'path/to/file.py:function'")
    if spec in REWARDS:
        return RewardFunction(spec, REWARDS[spec])
    if ":" not in spec:
        raise RewardError(
            f"reward {spec!r} is not registered; choose one of {', '.join(reward_names())}, "
            "or name a function as 'package.module:function' or 'path/to/file.py:function'"
        )
    module_part, _, attr = spec.rpartition(":")  # rpartition: a Windows drive letter keeps its colon
    if not module_part or not attr:
        raise RewardError(
            f"reward {spec!r}: write 'package.module:function' or 'path/to/file.py:function' (both parts non-empty)"
        )
    module = _module_from_file(spec, module_part) if _is_file_part(module_part) else _module_from_import(spec, module_part)
    try:
        fn = getattr(module, attr)
    except AttributeError:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        hint = f"; its public callables: {', '.join(found)}" if found else ""
        raise RewardError(f"reward {spec!r}: {module_part!r} has no attribute {attr!r}{hint}") from None
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: {attr!r} in {module_part!r} is a {type(fn).__name__}, not callable")
    try:
        inspect.signature(fn).bind("", "", "")
    except TypeError as e:
        raise RewardError(
            f"reward {spec!r}: {attr!r} cannot be called as fn(prompt, completion, target): {e}"
        ) from None
    except ValueError:
        pass  # some builtins have no introspectable signature; the first call will tell
    return RewardFunction(spec, fn)


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

    def weighted_sum(prompt: str, completion: str, target: str) -> float:
        return sum(w * part(prompt, completion, target) for w, part in parts)

    name = " + ".join(f"{w:g}*{part.name}" for w, part in parts)
    return RewardFunction(name, weighted_sum)


def reward_function(specs: Sequence[str], weights: Sequence[float] | None, task) -> RewardFn:
    """The run's reward (``algorithm.rewards``): the weighted sum of ``specs``, or, when there are
    none, the task's own reward (``Task.reward``)."""
    if specs:
        return combine_rewards(list(specs), list(weights) if weights else None)
    from elasticrl.rl.tasks import Example

    def task_reward(prompt: str, completion: str, target: str) -> float:
        return task.reward(Example(prompt=prompt, target=target), completion)

    return RewardFunction(f"task:{task.name}", task_reward)
