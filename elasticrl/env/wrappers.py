"""Limits around an env, as Gymnasium wrappers: the env itself never special-cases them.

``TurnLimit`` truncates an episode after ``max_turns`` steps (Gymnasium's ``TimeLimit`` for turns).
Wrappers forward sync and async envs alike: a wrapped ``async def`` method stays awaitable.
"""

from __future__ import annotations

import inspect
from typing import Any


class TurnLimit:
    """Sets ``truncated`` once ``max_turns`` steps were taken since the last ``reset``."""

    def __init__(self, env: Any, max_turns: int):
        if max_turns < 1:
            raise ValueError(f"max_turns: {max_turns} must be at least 1")
        self.env = env
        self.max_turns = max_turns
        self.turns = 0

    @property
    def unwrapped(self) -> Any:
        return getattr(self.env, "unwrapped", self.env)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.turns = 0
        return self.env.reset(seed=seed, options=options)

    def step(self, action: str):
        result = self.env.step(action)
        if inspect.isawaitable(result):
            return self._limit_async(result)
        return self._limit(result)

    async def _limit_async(self, pending):
        return self._limit(await pending)

    def _limit(self, result):
        self.turns += 1
        if not isinstance(result, tuple) or len(result) != 5 or self.turns < self.max_turns:
            return result  # malformed results are reported by base.call_step, with the env's name
        obs, reward, terminated, truncated, info = result
        return obs, reward, terminated, bool(truncated) or not terminated, info

    def close(self):
        close = getattr(self.env, "close", None)
        return close() if callable(close) else None
