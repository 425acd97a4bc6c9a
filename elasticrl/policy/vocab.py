"""A character vocabulary for toy tasks: three special tokens, then digits, letters and ``=:``.

Pure Python (no torch), so tasks and their tests can tokenize without loading a model.
"""

from __future__ import annotations

from collections.abc import Sequence

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz=:"


class CharVocab:
    """Maps characters of ``CHARS`` to ids after the specials; one character is one token."""

    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def __init__(self, chars: str = CHARS):
        assert len(set(chars)) == len(chars), f"duplicate characters in {chars!r}"
        self.chars = chars
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(chars)}

    def __len__(self) -> int:
        return len(SPECIALS) + len(self.chars)

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary {self.chars!r}") from None
        return [BOS, *ids] if bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text up to the first EOS; other special tokens are dropped."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= len(SPECIALS):
                out.append(self.chars[i - len(SPECIALS)])
        return "".join(out)
