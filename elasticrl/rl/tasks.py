"""Toy tasks with programmatic rewards, behind a name-keyed registry.

A task draws prompts from a seeded ``random.Random`` and scores a completion (decoded text, up to
EOS) with a reward in [0, 1]. They are small enough for a from-scratch policy to learn in a few
dozen RL iterations on a CPU, which is what the demo and the integration tests need. Pure Python.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: str
    """Text fed to the policy after BOS, e.g. ``"4071="``."""
    target: str
    """The completion that earns reward 1.0, e.g. ``"4071"``."""


class Task(Protocol):
    name: str
    max_new_tokens: int
    """Longest useful completion, tokens (the target plus EOS)."""

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        """``n`` prompts drawn from ``rng`` (same rng state -> same prompts)."""
        ...

    def reward(self, example: Example, completion: str) -> float:
        """Score in [0, 1]; 1.0 only for exactly ``example.target``."""
        ...


def positional_match(target: str, completion: str) -> float:
    """Fraction of positions where ``completion`` matches ``target``, over the longer of the two.

    Partial credit gives a from-scratch policy a gradient long before it gets a whole answer right;
    dividing by the longer length makes extra characters cost as much as missing ones.
    """
    longest = max(len(target), len(completion))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(target, completion)) / longest


class DigitsTask:
    """Prompts of ``num_digits`` random digits followed by ``=``; the target is ``transform(digits)``."""

    def __init__(self, name: str, num_digits: int, transform: Callable[[str], str]):
        if num_digits < 1:
            raise ValueError(f"num_digits: {num_digits} must be at least 1")
        self.name = name
        self.num_digits = num_digits
        self.transform = transform
        self.max_new_tokens = num_digits + 1

    def sample(self, rng: random.Random, n: int) -> list[Example]:
        out = []
        for _ in range(n):
            digits = "".join(rng.choice("0123456789") for _ in range(self.num_digits))
            out.append(Example(prompt=f"{digits}=", target=self.transform(digits)))
        return out

    def reward(self, example: Example, completion: str) -> float:
        return positional_match(example.target, completion)


TASKS: dict[str, Callable[[int], Task]] = {
    "copy": lambda num_digits: DigitsTask("copy", num_digits, lambda s: s),
    "reverse": lambda num_digits: DigitsTask("reverse", num_digits, lambda s: s[::-1]),
}


def make_task(name: str, num_digits: int) -> Task:
    """The registered task ``name``; an unknown name lists the valid ones."""
    try:
        factory = TASKS[name]
    except KeyError:
        raise ValueError(f"task {name!r} is not registered; choose one of {', '.join(sorted(TASKS))}") from None
    return factory(num_digits)
