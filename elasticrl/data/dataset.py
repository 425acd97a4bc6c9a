"""User datasets: read local data files into validated rows, split off eval rows, and stream them.

``load_rows`` reads a local ``.jsonl``/``.json``/``.parquet`` file or a ``save_to_disk``
directory through Hugging Face ``datasets`` (local files only, never the hub), checks every row
for the prompt (or chat messages) a task needs, and returns plain JSON-able dicts small enough to
travel to rollout engines. ``split_eval`` carves off a seeded held-out set; ``RowStream`` hands
rows out in a per-epoch shuffled order addressed by a global position, so a run resumed at
position ``p`` neither repeats nor skips rows.

Row numbering: validation errors name the row by its 0-based index among the records
(``row 17 (0-based)``; blank lines of a ``.jsonl`` file are not records). Parse errors in a JSON
file name the 1-based line of the file instead (``line 18``), as editors do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import random
import tempfile
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from elasticrl.errors import ElasticRLError

logger = logging.getLogger(__name__)

Row = dict[str, Any]
"""One dataset record: column name -> JSON value."""

MAX_ROW_BYTES = 60 * 1024
"""Largest row, as ``json.dumps(row)`` bytes: rows travel to rollout engines in a 64 KiB field."""

MESSAGE_ROLES = ("system", "user", "assistant", "tool")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
_INSTALL_HINT = "pip install 'elasticrl[data]' (or: pip install datasets)"


class DatasetError(ElasticRLError, ValueError):
    """A data file is missing, unreadable or holds a bad row; the message names file, row and key."""


def load_rows(
    path: str | os.PathLike[str], *, prompt_key: str = "", messages_key: str = "", what: str = "task.path"
) -> list[Row]:
    """Read and validate every row of a local dataset.

    Args:
        path: a ``.jsonl`` file, a ``.json`` file (JSON lines or one array of objects), a
            ``.parquet`` file, or a directory written by ``Dataset.save_to_disk`` or
            ``DatasetDict.save_to_disk`` (of a ``DatasetDict`` only the ``"train"`` split is read).
        prompt_key: column holding each row's prompt, a non-empty string.
        messages_key: column holding each row's chat messages: a non-empty list of
            ``{"role": one of MESSAGE_ROLES, "content": str}`` dicts. Give at most one of the two;
            with neither, rows are only read (an environment's rows need no prompt).
        what: the config field that named ``path``, quoted in error messages.

    Returns:
        The rows in file order as plain dicts (all columns kept; values are Python JSON types).
        Columns are unified across rows by Arrow: a key absent from some rows reads as ``None``
        there, and a column mixing ints and floats reads as floats.

    Raises:
        DatasetError: bad arguments, a missing/unreadable/empty file, or a row that fails
            validation (the first one found; the message names the file, the row and the key).
    """
    if prompt_key and messages_key:
        raise DatasetError(
            f"{what}={path}: give one of prompt_key (the column holding each row's prompt) "
            f"or messages_key (the column holding each row's chat messages), not both; got "
            f"prompt_key={prompt_key!r}, messages_key={messages_key!r}"
        )
    where = f"{what}={path}"
    raw_rows, columns = _read_rows(path, where)
    rows = []
    for index, raw in enumerate(raw_rows):
        row = _plain(raw)
        if prompt_key:
            _check_prompt(row, prompt_key, where, index)
        elif messages_key:
            _check_messages(row, messages_key, where, index)
        _check_size(row, where, index)
        rows.append(row)
    logger.info("loaded %d rows from %s (keys %s)", len(rows), path, ", ".join(columns))
    return rows


def describe(path: str | os.PathLike[str]) -> str:
    """One line for logs, e.g. ``"data/train.jsonl: 200 rows, keys prompt, answer"``."""
    rows, columns = _read_rows(path, str(path))
    return f"{path}: {len(rows)} rows, keys {', '.join(columns)}"


def split_eval(rows: list[Row], fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """Split ``rows`` into ``(train_rows, eval_rows)``, both in the original order.

    A seeded shuffle of the row indices picks ``round(fraction * len(rows))`` eval rows (at least
    one when ``fraction > 0``); at least one row must stay for training. ``fraction == 0`` gives
    ``(all rows, [])``. The same (rows, fraction, seed) always gives the same split.
    """
    if not 0.0 <= fraction < 1.0:
        raise DatasetError(f"eval fraction must be in [0, 1), got {fraction!r}; e.g. 0.05 holds out 5% of the rows")
    n = len(rows)
    if fraction == 0.0:
        return list(rows), []
    n_eval = max(1, round(fraction * n))
    if n_eval >= n:
        raise DatasetError(
            f"eval fraction {fraction} of {n} rows would hold out {n_eval} and leave no training rows; "
            f"lower the fraction or add rows"
        )
    order = list(range(n))
    random.Random(f"{seed}/eval-split").shuffle(order)
    held_out = set(order[:n_eval])
    train = [row for i, row in enumerate(rows) if i not in held_out]
    evals = [row for i, row in enumerate(rows) if i in held_out]
    return train, evals


class RowStream:
    """Rows in a per-epoch shuffled order, addressed by a global position.

    Position ``p`` is row ``epoch_order(p // n)[p % n]`` with ``n = len(rows)``; the order of an
    epoch depends only on (seed, epoch), so a run that persists the next position resumes
    exactly where it stopped: ``take(p, a) + take(p + a, b) == take(p, a + b)``.
    """

    _CACHED_EPOCHS = 2  # take() straddles at most two epochs per call in practice

    def __init__(self, rows: list[Row], seed: int, *, shuffle: bool = True):
        if not rows:
            raise DatasetError("RowStream needs at least one row; the dataset is empty")
        self._rows = rows
        self._seed = seed
        self._shuffle = shuffle
        self._orders: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        """Rows per epoch."""
        return len(self._rows)

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of ``range(len(self))`` that orders ``epoch`` (identity when not shuffling)."""
        return list(self._order(epoch))

    def epoch_of(self, position: int) -> int:
        """The epoch that global ``position`` falls in."""
        _check_non_negative("position", position)
        return position // len(self._rows)

    def take(self, position: int, count: int) -> list[tuple[int, Row]]:
        """``(p, row)`` for the ``count`` global positions from ``position``, crossing epochs as needed."""
        _check_non_negative("position", position)
        _check_non_negative("count", count)
        n = len(self._rows)
        return [(p, self._rows[self._order(p // n)[p % n]]) for p in range(position, position + count)]

    def _order(self, epoch: int) -> tuple[int, ...]:
        _check_non_negative("epoch", epoch)
        order = self._orders.get(epoch)
        if order is None:
            indices = list(range(len(self._rows)))
            if self._shuffle:
                random.Random(f"{self._seed}/epoch/{epoch}").shuffle(indices)
            order = tuple(indices)
            self._orders[epoch] = order
            while len(self._orders) > self._CACHED_EPOCHS:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(epoch)
        return order


def _check_non_negative(name: str, value: int) -> None:
    if value < 0:
        raise DatasetError(f"RowStream {name} must be >= 0, got {value}")


# --- reading -------------------------------------------------------------------------------------


def _import_datasets() -> Any:
    # Local files only: the offline switches make any hub access fail fast instead of hanging.
    # They take effect only if set before the first import of datasets/huggingface_hub.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as e:
        raise DatasetError(f"reading data files needs the Hugging Face datasets library: {_INSTALL_HINT}") from e
    return datasets


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """Silence datasets' progress bars and its own error logs (we raise a better error) for one read."""
    bars_were_on = datasets.is_progress_bar_enabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()


def _read_rows(path: str | os.PathLike[str], where: str) -> tuple[list[Row], list[str]]:
    """The rows at ``path`` (at least one, as ``Dataset.to_list`` gives them) and the column names."""
    resolved = pathlib.Path(path).expanduser().resolve()
    if not resolved.exists():
        raise DatasetError(f"{where}: no such file or directory: {resolved} (relative paths start at {os.getcwd()})")
    suffix = resolved.suffix.lower()
    if not resolved.is_dir() and suffix not in JSON_SUFFIXES + PARQUET_SUFFIXES:
        raise DatasetError(
            f"{where}: unknown data file type {suffix or '(no extension)'!r}; use a .jsonl, .json or .parquet "
            f"file or a directory written by datasets' save_to_disk"
        )
    if suffix in JSON_SUFFIXES and not resolved.is_dir() and _is_blank(resolved):
        raise DatasetError(f"{where}: the file is empty; it needs at least one row")
    datasets = _import_datasets()
    with _quiet(datasets):
        if resolved.is_dir():
            dataset = _read_directory(datasets, resolved, where)
        else:
            dataset = _read_file(datasets, resolved, suffix, where)
    if len(dataset) == 0:
        raise DatasetError(f"{where}: the dataset has no rows; it needs at least one")
    try:
        return dataset.to_list(), list(dataset.column_names)
    except Exception as e:  # pyarrow decodes strings only here: bad UTF-8 surfaces now
        located = _locate_json_problem(resolved) if resolved.is_file() and suffix in JSON_SUFFIXES else ""
        raise DatasetError(f"{where}: {located or f'could not convert the rows: {_root_cause(e)}'}") from e


def _read_directory(datasets: Any, resolved: pathlib.Path, where: str) -> Any:
    try:
        loaded = datasets.load_from_disk(str(resolved), keep_in_memory=True)
    except Exception as e:
        if any((resolved / name).exists() for name in ("state.json", "dataset_dict.json")):
            # A saved dataset with no rows (zero shards) fails inside load_from_disk.
            raise DatasetError(
                f"{where}: datasets could not read the save_to_disk directory {resolved} ({_root_cause(e)}); "
                f"check that it holds at least one row"
            ) from e
        raise DatasetError(
            f"{where}: the directory {resolved} is not one written by datasets' save_to_disk "
            f"({_root_cause(e)}); point at a .jsonl, .json or .parquet file or a save_to_disk directory"
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DatasetError(
                f"{where}: the saved DatasetDict has no 'train' split (splits: {', '.join(loaded) or 'none'}); "
                f"save the rows to use under the name 'train' or point at the split's own directory"
            )
        return loaded["train"]
    return loaded


def _read_file(datasets: Any, resolved: pathlib.Path, suffix: str, where: str) -> Any:
    builder = "json" if suffix in JSON_SUFFIXES else "parquet"
    # The build cache goes to a private temp dir, never next to the user's data, and is removed
    # with it; keep_in_memory keeps the rows themselves out of any cache file.
    with tempfile.TemporaryDirectory(prefix="elasticrl-datasets-") as cache_dir:

        def load(data_file: pathlib.Path) -> Any:
            return datasets.load_dataset(
                builder, data_files=str(data_file), split="train", keep_in_memory=True, cache_dir=cache_dir
            )

        try:
            return load(resolved)
        except Exception as e:
            if builder == "parquet":
                raise DatasetError(f"{where}: not a readable parquet file: {_root_cause(e)}") from e
            located = _locate_json_problem(resolved)
            if located:
                raise DatasetError(f"{where}: {located}") from e
            # datasets 5.x fails on valid JSON lines when a column mixes types and the file has a
            # blank line (a trailing one included); the same records without blank lines read fine.
            compact = pathlib.Path(cache_dir) / f"rows{suffix}"
            if _copy_without_blank_lines(resolved, compact):
                with contextlib.suppress(Exception):
                    return load(compact)
            raise DatasetError(f"{where}: could not read the JSON file: {_root_cause(e)}") from e


def _copy_without_blank_lines(src: pathlib.Path, dst: pathlib.Path) -> bool:
    """Copy a JSON-lines file minus its blank lines; False (and no copy) if it has none."""
    with src.open("rb") as f:
        lines = f.readlines()
    kept = [line for line in lines if line.strip()]
    if len(kept) == len(lines) or kept[0].lstrip().startswith(b"["):
        return False
    dst.write_bytes(b"".join(line if line.endswith(b"\n") else line + b"\n" for line in kept))
    return True


def _is_blank(path: pathlib.Path) -> bool:
    with path.open("rb") as f:
        return not any(chunk.strip() for chunk in iter(lambda: f.read(1 << 16), b""))


def _root_cause(error: BaseException) -> str:
    """The innermost ``__cause__`` (datasets wraps pyarrow's message, which says what went wrong)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {error}"


def _locate_json_problem(path: pathlib.Path) -> str:
    """Describe the first thing wrong with a JSON / JSON-lines file, or ``""`` if nothing is found.

    pyarrow's JSON reader does not say which line failed, so the file is re-scanned with ``json``.
    """
    with path.open("rb") as f:
        head = f.read(1 << 16).lstrip()
    if head.startswith(b"["):
        try:
            value = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return f"invalid JSON array: {_decode_error(e)}"
        for index, item in enumerate(value):
            if not isinstance(item, dict):
                return f"element {index} (0-based) of the JSON array is a {_json_type(item)}, not an object"
        return ""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                return f"line {lineno}: invalid JSON: {_decode_error(e, in_line=True)}; each line must be one JSON object"
            if not isinstance(value, dict):
                return f"line {lineno} holds a JSON {_json_type(value)}, not an object; each line must be one object"
    return ""


def _decode_error(error: ValueError, *, in_line: bool = False) -> str:
    if not isinstance(error, json.JSONDecodeError):
        return f"not UTF-8 ({error})"
    return f"{error.msg} at {'' if in_line else f'line {error.lineno} '}column {error.colno}"


def _json_type(value: object) -> str:
    names = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# --- rows ----------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Plain Python containers and scalars (numpy/pyarrow scalars and arrays converted)."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return _plain(value.tolist())
    if hasattr(value, "as_py"):  # pyarrow scalars
        return _plain(value.as_py())
    return value  # anything else (bytes, datetime) is caught by the JSON check


def _row_at(where: str, index: int) -> str:
    return f"{where}: row {index} (0-based)"


def _missing(row: Row, key: str, where: str, index: int, option: str) -> DatasetError:
    present = ", ".join(k for k, v in row.items() if v is not None) or "none"
    return DatasetError(
        f"{_row_at(where, index)} has no key {key!r} (or it is null); its keys: {present}. "
        f"Add {key!r} to every row or set {option} to the column that holds it"
    )


def _check_prompt(row: Row, key: str, where: str, index: int) -> None:
    value = row.get(key)
    if value is None:
        raise _missing(row, key, where, index, "prompt_key")
    if not isinstance(value, str):
        raise DatasetError(f"{_row_at(where, index)}: key {key!r} must be a string, got {_json_type(value)} {_short(value)}")
    if not value.strip():
        raise DatasetError(f"{_row_at(where, index)}: key {key!r} is an empty (or whitespace-only) prompt; fix the row")


def _check_messages(row: Row, key: str, where: str, index: int) -> None:
    value = row.get(key)
    if value is None:
        raise _missing(row, key, where, index, "messages_key")
    at = f"{_row_at(where, index)}: key {key!r}"
    if not isinstance(value, list):
        raise DatasetError(f"{at} must be a list of chat messages, got {_json_type(value)} {_short(value)}")
    if not value:
        raise DatasetError(f"{at} is an empty list; give every row at least one message")
    for m, message in enumerate(value):
        fix = f'each message is {{"role": one of {", ".join(MESSAGE_ROLES)}, "content": "..."}}'
        if not isinstance(message, dict):
            raise DatasetError(f"{at}: message {m} is a {_json_type(message)}, not an object; {fix}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in MESSAGE_ROLES:
            raise DatasetError(f"{at}: message {m} has role {role!r}; {fix}")
        if not isinstance(content, str):
            raise DatasetError(f"{at}: message {m} has content {_short(content)}, not a string; {fix}")


def _check_size(row: Row, where: str, index: int) -> None:
    try:
        # The default json.dumps (ASCII escapes, spaced separators) is the largest common
        # encoding, so a row that passes here fits however the transport serialises it.
        size = len(json.dumps(row))
    except (TypeError, ValueError) as e:
        bad = next((k for k, v in row.items() if not _dumps_ok(v)), "?")
        raise DatasetError(
            f"{_row_at(where, index)}: key {bad!r} is not JSON-serializable ({e}); "
            f"convert that column to strings or numbers, or drop it"
        ) from e
    if size > MAX_ROW_BYTES:
        raise DatasetError(
            f"{_row_at(where, index)} is {size} bytes as JSON, over the limit of {MAX_ROW_BYTES} bytes "
            f"(rows travel to rollout engines in a 64 KiB field); shorten it or drop columns the task does not use"
        )


def _dumps_ok(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
