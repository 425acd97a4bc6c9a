"""Reading the few facts both engines need from a local Hugging Face model directory.

Plain JSON reads, no transformers import: which token ids end a sequence, whether a tokenizer is
there, and a clear error when the path is not a model directory at all.
"""

from __future__ import annotations

import json
import os
import pathlib

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_model_dir(model_dir: str | os.PathLike[str]) -> pathlib.Path:
    """The directory as a Path; raises FileNotFoundError unless it holds a ``config.json``."""
    path = pathlib.Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a Hugging Face model directory (no config.json); "
            "pass a directory written by save_pretrained() or an HF checkpoint export"
        )
    return path


def has_tokenizer(path: pathlib.Path) -> bool:
    """True if the directory holds tokenizer files (then loading them must succeed)."""
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def _ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[union-attr]


def eos_token_ids(path: pathlib.Path) -> tuple[int, ...]:
    """The ids that end a sample: ``generation_config.json``'s ``eos_token_id`` (int or list) if
    set, else ``config.json``'s; empty if neither names one."""
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            ids = _ids(json.loads(file.read_text()).get("eos_token_id"))
            if ids:
                return ids
    return ()
