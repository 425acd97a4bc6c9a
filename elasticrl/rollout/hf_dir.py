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


def weights_problem(path: pathlib.Path) -> str | None:
    """What is wrong with the directory's weights, None if it has safetensors ones."""
    if any(path.glob("*.safetensors")):
        return None
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        return ("only pickle weights (.bin/.pt), and elasticrl loads safetensors only: convert once with "
                "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)")
    return "no weights (*.safetensors)"


def check_model_files(model_dir: str | os.PathLike[str]) -> pathlib.Path:
    """The directory as a Path; raises FileNotFoundError naming everything a run needs there and
    does not find: config.json, safetensors weights, a tokenizer. File checks only (no import)."""
    path = pathlib.Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is not a directory (looked at {path.absolute()})")
    missing = [] if (path / "config.json").is_file() else ["no config.json"]
    missing += [p for p in (weights_problem(path),) if p is not None]
    if not has_tokenizer(path):
        missing.append(f"no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    if missing:
        raise FileNotFoundError(
            f"{str(path)!r} is not a complete Hugging Face model directory: {'; '.join(missing)}. Pass a directory "
            "written by model.save_pretrained(dir) and tokenizer.save_pretrained(dir), or by checkpoint.export_hf"
        )
    return path


def has_chat_template(path: pathlib.Path) -> bool:
    """True if the directory's tokenizer has a chat template: in tokenizer_config.json, or in the
    chat_template.jinja / chat_template.json that newer transformers save beside it."""
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    config = path / "tokenizer_config.json"
    try:
        return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False  # loading the tokenizer will say what is wrong with the file


def model_positions(path: pathlib.Path) -> int:
    """The model's context in tokens from ``config.json`` (``max_position_embeddings``, or GPT-2's
    ``n_positions``); 0 if it names none or cannot be read."""
    try:
        config = json.loads((path / "config.json").read_text())
        return int(config.get("max_position_embeddings") or config.get("n_positions") or 0)
    except (OSError, ValueError, TypeError):
        return 0


def tied_embeddings(path: pathlib.Path) -> bool:
    """Whether the model's output head is its input embedding (``config.json``'s
    ``tie_word_embeddings``, True when absent, as transformers takes it)."""
    return bool(json.loads((path / "config.json").read_text()).get("tie_word_embeddings", True))


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
