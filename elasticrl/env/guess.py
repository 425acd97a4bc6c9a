"""``guess``: a number-guessing game with higher/lower feedback, the multi-turn env a tiny policy learns.

The env picks a secret in ``[low, high]``; each turn the policy guesses and hears ``hi`` (the secret
is higher), ``lo`` (lower) or wins. Feedback is what makes it multi-turn: a policy that reads the
earlier turns bisects and always wins within ``ceil(log2(high - low + 2))`` guesses, a policy that
ignores them wins by luck. The text uses only the demo's character vocabulary (digits, lowercase
letters, ``:`` and ``=``), so the built-in tiny transformer can play it from scratch:

    guess:3<eos>hi:7<eos>lo:5<eos>        (secret 5: reward 1 on the third turn)

Which secret: ``options["secret"]`` if the row names one, else ``options["instance"]`` (every
episode of a GRPO group shares its task's row, so they play the same secret and their returns are
comparable), else the reset ``seed``. Rewards: ``win_reward`` on the winning step, minus
``turn_penalty`` for every turn taken (winning sooner is better), plus ``consistent_reward`` for
a wrong guess that the earlier feedback still allowed (inside the interval the ``hi``/``lo``
answers left open): a dense signal for *reading* the feedback, which the win alone teaches slowly.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

_DIGITS = re.compile(r"[0-9]+")


class GuessEnv:
    """Guess a secret integer in ``[low, high]`` (the range must fit in one or two digits each turn).

    Args:
        low, high: the secret's range, inclusive.
        win_reward: reward of the winning step.
        turn_penalty: subtracted at every step, win or not.
    """

    def __init__(self, *, low: int = 0, high: int = 9, win_reward: float = 1.0, turn_penalty: float = 0.0,
                 consistent_reward: float = 0.0):
        if not 0 <= low < high <= 99:
            raise ValueError(f"low/high: [{low}, {high}] must satisfy 0 <= low < high <= 99")
        self.low, self.high = low, high
        self.win_reward = win_reward
        self.turn_penalty = turn_penalty
        self.consistent_reward = consistent_reward
        self.secret = low
        self.guesses: list[int] = []
        self.open = (low, high)
        """The interval the feedback so far leaves open."""

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[str, dict]:
        row = options or {}
        span = self.high - self.low + 1
        if "secret" in row:
            secret = row["secret"]
            if isinstance(secret, bool) or not isinstance(secret, int) or not self.low <= secret <= self.high:
                raise ValueError(f"options['secret']: {secret!r} must be an int in [{self.low}, {self.high}]")
        elif isinstance(row.get("instance"), int):
            secret = self.low + row["instance"] % span
        else:
            secret = random.Random(seed).randint(self.low, self.high)
        self.secret = secret
        self.guesses = []
        self.open = (self.low, self.high)
        return "guess:", {"secret": secret}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        # Lenient on purpose: the first number in the action is the guess, so a policy that has not
        # yet learned the format still plays (and learns the game, not only the syntax).
        found = _DIGITS.search(action)
        if found is None:
            return "bad:", 0.0 - self.turn_penalty, False, False, {"valid_action": False}
        guess = int(found.group()[:2])
        self.guesses.append(guess)
        low, high = self.open
        info = {"valid_action": True, "guess": guess, "secret": self.secret, "consistent": low <= guess <= high}
        if guess == self.secret:
            return "", self.win_reward - self.turn_penalty, True, False, info
        reward = (self.consistent_reward if info["consistent"] else 0.0) - self.turn_penalty
        if self.secret > guess:
            self.open = (max(low, guess + 1), high)
            return "hi:", reward, False, False, info
        self.open = (low, min(high, guess - 1))
        return "lo:", reward, False, False, info
