"""The environment contract: Gymnasium's ``reset``/``step`` with text actions, sync or async.

An environment is any object with

* ``reset(seed=None, options=None) -> (observation, info)``: ``options`` is the task's dataset row
  (a dict, ``{}`` when the run has no dataset); ``seed`` differs between the episodes of one GRPO
  group, so an env that draws randomness from it gives each episode its own draw;
* ``step(action: str) -> (observation, reward, terminated, truncated, info)``: ``action`` is the
  policy's decoded turn; ``reward`` a float for this step (the episode's return is their sum);
* optionally ``close()``: called once when the env is discarded;
* optionally ``stop_strings``: texts that end an action (Search-R1's ``</search>``). The turn is
  cut after the first token that completes one, as an engine's stop sequence would: what the
  policy wrote after it is neither shown to the env nor trained on.

Either method may be ``async def``. An observation is a ``str`` (appended to the episode as text)
or a list of chat messages (``{"role": ..., "content": ...}`` dicts, rendered with the model's chat
template); other types (a screenshot for a vision-language policy) are reserved for a later
version and refused with a clear error. One env instance runs one episode at a time and is reused
for later episodes through ``reset``; the runner makes as many instances as it has live episodes.

This module knows nothing of engines, tokenizers or the scheduler: ``call_reset``/``call_step``
only call the env and check what it returned, raising ``EnvError`` naming the env, the method and
what was wrong.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from elasticrl.errors import ElasticRLError
from elasticrl.plugins import module_label

Message = Mapping[str, Any]
"""A chat message: ``{"role": "user" | "assistant" | "system" | "tool", "content": str}``."""
Observation = str | list[Message]
"""What an env shows the policy: text, or chat messages."""


class EnvError(ElasticRLError, RuntimeError):
    """An environment raised, returned something malformed, or passed its step timeout. Fails
    the episode it happened in (its group is retried once on another engine), not the run."""


class EnvLoadError(ElasticRLError, ValueError):
    """An ``[env] name`` cannot be resolved or the class cannot be built; the message names the
    spec and the fix."""


@runtime_checkable
class Env(Protocol):
    """What the episode runner needs from an environment (sync or ``async def`` methods)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Observation, dict[str, Any]]:
        """Start an episode of the task ``options`` (the dataset row); returns the first
        observation and an info dict."""
        ...

    def step(self, action: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        """Apply the policy's ``action``; returns (observation, reward, terminated, truncated, info).
        ``terminated``: the task ended (solved or failed); ``truncated``: cut short from outside."""
        ...


def stop_strings(env: object) -> tuple[str, ...]:
    """The env's ``stop_strings`` (under its wrappers), checked: a str or a sequence of non-empty str."""
    value = getattr(getattr(env, "unwrapped", env), "stop_strings", ())
    values = (value,) if isinstance(value, str) else value
    try:
        out = tuple(values)
    except TypeError:
        out = ()
    if not all(isinstance(s, str) and s for s in out) or (value and not out):
        raise EnvError(f"env {env_label(env)}: stop_strings = {value!r} must be a str or a sequence of non-empty str")
    return out


def cut_at_stop(ids: list[int], stops: tuple[str, ...], decode: Callable[[list[int]], str]) -> int:
    """How many of ``ids`` to keep: up to the first token whose decoded prefix contains one of
    ``stops``, else all. A prefix that contains one stays containing it, so a binary search over
    prefix lengths finds it in a few decodes."""
    if not stops or not any(s in decode(ids) for s in stops):
        return len(ids)
    lo, hi = 1, len(ids)  # the shortest prefix that contains a stop is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


def env_label(env: object) -> str:
    """``module:Class`` of an env (under its wrappers), for error messages."""
    cls = type(getattr(env, "unwrapped", env))
    return f"{module_label(cls.__module__)}:{cls.__qualname__}"


RunSync = Callable[[Callable[[], Any]], Awaitable[Any]]
"""Runs a blocking call off the event loop (e.g. ``loop.run_in_executor(pool, fn)``)."""


async def _call(env: object, method: str, *args: Any, run_sync: RunSync | None = None, **kwargs: Any) -> Any:
    fn = getattr(env, method, None)
    if not callable(fn):
        raise EnvError(f"env {env_label(env)} has no {method}() method; an env needs reset(seed, options) and step(action)")
    try:
        if run_sync is not None and not inspect.iscoroutinefunction(fn):
            # A sync env may block (HTTP, a browser): never on the event loop that drives the others.
            result = await run_sync(functools.partial(fn, *args, **kwargs))
        else:
            result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
    except (EnvError, ElasticRLError):
        raise  # elasticrl's own errors (a reward function failing inside the prompt env) are not the env's
    except Exception as exc:
        raise EnvError(f"env {env_label(env)}.{method}() raised {type(exc).__name__}: {exc}") from exc
    return result


def check_observation(env: object, method: str, obs: Any) -> Observation:
    """``obs`` if it is text or a list of chat messages; ``EnvError`` otherwise."""
    if isinstance(obs, str):
        return obs
    if isinstance(obs, list) and all(isinstance(m, Mapping) for m in obs):
        for i, m in enumerate(obs):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise EnvError(
                    f"env {env_label(env)}.{method}(): observation message {i} is {dict(m)!r}; a chat message needs "
                    "a string 'role' and a string 'content'"
                )
        return obs
    raise EnvError(
        f"env {env_label(env)}.{method}(): the observation is a {type(obs).__name__} ({repr(obs)[:80]}); return a str or "
        "a list of {'role': ..., 'content': ...} chat messages (image observations are not supported yet)"
    )


def _check_info(env: object, method: str, info: Any) -> dict[str, Any]:
    if info is None:
        return {}
    if not isinstance(info, Mapping):
        raise EnvError(f"env {env_label(env)}.{method}(): info is a {type(info).__name__}, expected a dict")
    return dict(info)


async def call_reset(
    env: object, *, seed: int | None, options: dict[str, Any], run_sync: RunSync | None = None,
) -> tuple[Observation, dict[str, Any]]:
    """``env.reset(seed=seed, options=options)``, awaited if async (``run_sync`` runs a sync one
    off the loop; None calls it inline), its result checked."""
    result = await _call(env, "reset", run_sync=run_sync, seed=seed, options=options)
    if not isinstance(result, tuple) or len(result) != 2:
        raise EnvError(
            f"env {env_label(env)}.reset() returned {type(result).__name__} {repr(result)[:80]}; it must return "
            "(observation, info), as in Gymnasium"
        )
    obs, info = result
    return check_observation(env, "reset", obs), _check_info(env, "reset", info)


async def call_step(
    env: object, action: str, *, run_sync: RunSync | None = None,
) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
    """``env.step(action)``, awaited if async, its 5-tuple checked (reward finite, flags bools)."""
    result = await _call(env, "step", action, run_sync=run_sync)
    if not isinstance(result, tuple) or len(result) != 5:
        raise EnvError(
            f"env {env_label(env)}.step() returned {type(result).__name__} {repr(result)[:80]}; it must return "
            "(observation, reward, terminated, truncated, info), as in Gymnasium"
        )
    obs, reward, terminated, truncated, info = result
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvError(f"env {env_label(env)}.step(): reward {reward!r} is not a finite number")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        # bool or int, numpy's bool_ too (Gymnasium's own checker takes it), never a float
        if not isinstance(flag, (bool, int, np.bool_)):
            raise EnvError(f"env {env_label(env)}.step(): {name} is {flag!r}; it must be a bool")
    done = bool(terminated) or bool(truncated)
    # A final observation is never shown to the policy; let an env return None there.
    obs = "" if done and obs is None else check_observation(env, "step", obs)
    return obs, float(reward), bool(terminated), bool(truncated), _check_info(env, "step", info)


async def call_close(env: object, *, run_sync: RunSync | None = None) -> None:
    """``env.close()`` if it has one (sync or async); errors are the caller's to log."""
    if callable(getattr(env, "close", None)):
        await _call(env, "close", run_sync=run_sync)
