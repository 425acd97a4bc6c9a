"""Observations into tokens: how an episode's context grows between the policy's turns.

An episode is one token sequence: the first observation (with BOS or the chat template's header
and generation prompt), the policy's action tokens exactly as the engine drew them
(token-in-token-out: the next turn sees the very ids that were sampled, never a re-tokenization of
their text), then the next observation's tokens, and so on. A ``Renderer`` makes the observation
tokens:

* ``PlainRenderer``: text observations encoded as they are, BOS before the first one (the tiny
  character model, or an HF model used without its chat template).
* ``ChatRenderer``: the tokenizer's chat template. The first observation is rendered as a whole
  conversation with the generation prompt; every later one as the *delta* the template adds for
  it, found with a fixed base conversation (SkyRL's and verl's approach): render ``base + new``
  and drop the base's tokens, where the base is cut right after its last end-of-turn token,
  because the engine stops at that token and what the template puts after it (Qwen's newline)
  must come with the next observation. A text observation becomes a user message.

An action that ran out of tokens (``finish_reason == "length"``) never produced the end-of-turn
token, so ``ChatRenderer.close_action`` supplies it (masked out of the loss).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from elasticrl.env.base import EnvError, Observation

BASE_CONVERSATION = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
    {"role": "assistant", "content": "I am an assistant."},
)


class Renderer(Protocol):
    def first(self, obs: Observation) -> list[int]:
        """Tokens that open an episode with observation ``obs`` (ends where the policy speaks)."""
        ...

    def next(self, obs: Observation) -> list[int]:
        """Tokens of a later observation, appended right after the policy's previous action."""
        ...

    def close_action(self, stopped: bool) -> list[int]:
        """Tokens that end an action (empty when the engine's stop token already did)."""
        ...

    def as_text(self, obs: Observation) -> str:
        """``obs`` as plain text, for transcripts and reward functions."""
        ...


def observation_text(obs: Observation) -> str:
    if isinstance(obs, str):
        return obs
    return "\n".join(f"{m['role']}: {m['content']}" for m in obs)


class PlainRenderer:
    """Text observations encoded as they are. ``encode(text, bos)`` is the codec's."""

    def __init__(self, encode: Callable[[str, bool], list[int]]):
        self.encode = encode

    def _text(self, obs: Observation) -> str:
        if not isinstance(obs, str):
            raise EnvError(
                "the env returned chat messages but this run renders plain text: set task.chat_template = true "
                "(an HF model whose tokenizer has a chat template), or return a str observation"
            )
        return obs

    def first(self, obs: Observation) -> list[int]:
        return list(self.encode(self._text(obs), True))

    def next(self, obs: Observation) -> list[int]:
        return list(self.encode(self._text(obs), False))

    def close_action(self, stopped: bool) -> list[int]:
        return []

    def as_text(self, obs: Observation) -> str:
        return observation_text(obs)


def _ids(rendered: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)`` gives a list, or a BatchEncoding in newer transformers."""
    if isinstance(rendered, Sequence) and not isinstance(rendered, str):
        return [int(t) for t in rendered]
    return [int(t) for t in rendered["input_ids"]]


class ChatRenderer:
    """Observations through ``tokenizer.apply_chat_template``.

    Args:
        tokenizer: an HF tokenizer with a chat template.
        turn_end_ids: tokens that end an assistant turn (the engine's stop ids; the first one
            closes an action cut by the length limit).
    """

    def __init__(self, tokenizer: Any, turn_end_ids: Sequence[int]):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "task.chat_template = true: the model's tokenizer has no chat template "
                "(neither tokenizer_config.json nor a chat_template.jinja has one); use a chat/instruct checkpoint or set it to false"
            )
        if not turn_end_ids:
            raise ValueError("ChatRenderer: turn_end_ids is empty; the model needs an EOS / end-of-turn token")
        self.tokenizer = tokenizer
        self.turn_end_ids = tuple(int(t) for t in turn_end_ids)
        base = self._render(list(BASE_CONVERSATION), generation_prompt=False)
        ends = [i for i, t in enumerate(base) if t in self.turn_end_ids]
        # Cut after the base's last end-of-turn: what the template adds after it belongs to the next message.
        self.base_ids = base[: ends[-1] + 1] if ends else base

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> list[int]:
        return _ids(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True))

    @staticmethod
    def _messages(obs: Observation) -> list[dict]:
        if isinstance(obs, str):
            return [{"role": "user", "content": obs}]
        return [dict(m) for m in obs]

    def first(self, obs: Observation) -> list[int]:
        return self._render(self._messages(obs), generation_prompt=True)

    def next(self, obs: Observation) -> list[int]:
        full = self._render([*BASE_CONVERSATION, *self._messages(obs)], generation_prompt=True)
        if full[: len(self.base_ids)] != self.base_ids:
            raise EnvError(
                "the chat template does not render a conversation as a prefix of its continuation, so an "
                "observation's tokens cannot be appended turn by turn; use a str observation without the template"
            )
        return full[len(self.base_ids):]

    def close_action(self, stopped: bool) -> list[int]:
        return [] if stopped else [self.turn_end_ids[0]]

    def as_text(self, obs: Observation) -> str:
        return observation_text(obs)
