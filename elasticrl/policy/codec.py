"""The text <-> token-id surface the RL loop needs from a tokenizer, whatever the policy.

Tasks build prompts and rewards read completions as text; everything between is token ids. The
demo's ``CharVocab`` and a Hugging Face tokenizer spell the same few facts differently (one EOS id
vs a list, a BOS or none, a pad id or none), so the loop talks to a ``TextCodec`` and never to
either directly: ``CharCodec`` adapts ``CharVocab`` here, ``elasticrl.policy.hf_policy.HFCodec``
adapts an HF tokenizer. Pure Python: no torch, no transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from elasticrl.policy.vocab import CharVocab


@runtime_checkable
class TextCodec(Protocol):
    """What the RL loop needs from a tokenizer.

    Invariants: ``pad_id`` is a valid id of the model (padding is masked out, so any id works, but
    it must embed); ``eos_ids`` is non-empty and every id in it ends a sample; ``encode`` never
    appends EOS.
    """

    @property
    def pad_id(self) -> int:
        """Id written into padded positions (masked out by ``valid``)."""
        ...

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Ids that end a completion (the engines' default stop set)."""
        ...

    @property
    def bos_id(self) -> int | None:
        """Id put in front of a prompt by ``encode(..., bos=True)``; None if the model has none."""
        ...

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of ``text``, with ``bos_id`` in front if ``bos`` and the model has one."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens."""
        ...


class CharCodec:
    """``TextCodec`` over the demo's ``CharVocab`` (one character is one token).

    ``decode`` keeps ``CharVocab.decode``'s rule: text up to the first EOS, other specials dropped.
    """

    def __init__(self, vocab: CharVocab | None = None):
        self.vocab = vocab if vocab is not None else CharVocab()

    @property
    def pad_id(self) -> int:
        return self.vocab.pad_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.vocab.eos_id,)

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return self.vocab.encode(text, bos=bos)

    def decode(self, ids: Sequence[int]) -> str:
        return self.vocab.decode(ids)

    def __repr__(self) -> str:
        return f"CharCodec({self.vocab.chars!r})"
