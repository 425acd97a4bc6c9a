"""The single-turn env: a dataset row's prompt in, one completion out, scored by the reward functions.

A plain prompt dataset is an episode of one turn, so datasets and multi-turn environments share one
rollout path: ``reset`` shows the row's prompt (text, or chat messages when the row has them),
``step`` scores the completion with ``score(prompt, completion, row)`` and terminates. The toy digit
tasks run this way too (their rows are ``{"prompt": "4071=", "target": "1704"}``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from elasticrl.env.base import Observation

Score = Callable[[str, str, Mapping[str, Any]], float]
"""score(prompt text, completion text, row) -> reward; ``rl.rewards.RewardFunction.score`` is one."""


def prompt_text(prompt: Observation) -> str:
    """The text a reward function sees as ``prompt``: the text itself, or the content of the last
    user message of a chat prompt."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else (prompt[-1]["content"] if prompt else "")


class PromptEnv:
    """One turn on one row.

    Args:
        score: the reward of a completion, ``score(prompt, completion, row)``.
        prompt_key: the row's text prompt field (used when ``messages_key`` is empty).
        messages_key: the row's chat-messages field; when set, the observation is those messages.
    """

    def __init__(self, *, score: Score, prompt_key: str = "prompt", messages_key: str = ""):
        self.score = score
        self.prompt_key = prompt_key
        self.messages_key = messages_key
        self._row: Mapping[str, Any] = {}
        self._prompt = ""

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[Observation, dict]:
        row = dict(options or {})
        key = self.messages_key or self.prompt_key
        if key not in row:
            raise KeyError(f"the task's row has no {key!r} field (it has: {', '.join(sorted(row)) or 'nothing'})")
        obs = row[key]
        if self.messages_key:
            obs = [dict(m) for m in obs]
        self._row, self._prompt = row, prompt_text(obs)
        return obs, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        return "", float(self.score(self._prompt, action, self._row)), True, False, {}
