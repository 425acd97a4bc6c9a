"""User datasets: read local data files into validated rows, split off eval rows, and stream them.

``load_rows`` reads a local ``.jsonl``/``.json`` file with ``json``, or a ``.parquet`` file or a
``save_to_disk`` directory through Hugging Face ``datasets`` (local files only, never the hub), checks every row
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
    path: str | os.PathLike[str], *, prompt_key: str = "", messages_key: str = "", what: str = "task.path",
    alphabet: str = "",
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
        alphabet: with ``prompt_key``, the only characters a prompt may hold (a policy that cannot
            tokenize others, the tiny one); empty: any.

    Returns:
        The rows in file order as plain dicts (all columns kept; values are Python JSON types).
        A key absent from some rows reads as ``None`` there. A JSON file's values are exactly as
        written (read with ``json``); a parquet file or a ``save_to_disk`` directory has Arrow's
        typed columns.

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
            _check_prompt(row, prompt_key, where, index, alphabet)
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
    if suffix in JSON_SUFFIXES and not resolved.is_dir():
        rows = _read_json(resolved, where)
        if not rows:
            raise DatasetError(f"{where}: the file is empty; it needs at least one row")
        columns = list(dict.fromkeys(key for row in rows for key in row))
        return [{key: row.get(key) for key in columns} for row in rows], columns
    datasets = _import_datasets()
    with _quiet(datasets):
        if resolved.is_dir():
            dataset = _read_directory(datasets, resolved, where)
        else:
            dataset = _read_parquet(datasets, resolved, where)
    if len(dataset) == 0:
        raise DatasetError(f"{where}: the dataset has no rows; it needs at least one")
    try:
        return dataset.to_list(), list(dataset.column_names)
    except Exception as e:  # pyarrow decodes strings only here: bad UTF-8 surfaces now
        raise DatasetError(f"{where}: could not convert the rows: {_root_cause(e)}") from e


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


def _read_parquet(datasets: Any, resolved: pathlib.Path, where: str) -> Any:
    # The build cache goes to a private temp dir, never next to the user's data, and is removed
    # with it; keep_in_memory keeps the rows themselves out of any cache file.
    with tempfile.TemporaryDirectory(prefix="elasticrl-datasets-") as cache_dir:
        try:
            return datasets.load_dataset(
                "parquet", data_files=str(resolved), split="train", keep_in_memory=True, cache_dir=cache_dir
            )
        except Exception as e:
            raise DatasetError(f"{where}: not a readable parquet file: {_root_cause(e)}") from e


def _root_cause(error: BaseException) -> str:
    """The innermost ``__cause__`` (datasets wraps pyarrow's message, which says what went wrong)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {error}"


class _DuplicateKey(ValueError):
    pass


class _NotJson(ValueError):
    pass


def _no_constant(name: str) -> None:
    raise _NotJson(f"{name} is not a JSON value (Python's json reads it; nothing else does)")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def _lone_surrogate(value: Any) -> str | None:
    """A string in ``value`` that is not valid Unicode (a lone ``\\ud800`` escape), if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value
        return None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((bad for item in items if (bad := _lone_surrogate(item)) is not None), None)


def _read_json(path: pathlib.Path, where: str) -> list[Row]:
    """The objects of a JSON-lines file, or of a file holding one JSON array, read with ``json``:
    values exactly as written (datasets' reader built its columns from the first 10 MB, so a key
    first seen later failed the file; it decoded strings that look like JSON in a mixed column,
    rounded an array file's floats to 10 digits, made big integers floats, read a ``null`` line
    as a row of nulls, and named the row of a parse error within its own chunk). Errors name the
    1-based line (of a JSON-lines file) or the 0-based element (of an array)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"{where}: cannot read the file: {e}") from e
    if data.lstrip()[:1] == b"[":
        try:
            value = json.loads(data, object_pairs_hook=_object, parse_constant=_no_constant)
        except _DuplicateKey as e:
            raise DatasetError(f"{where}: invalid JSON array: an object repeats the key {e.args[0]!r}") from None
        except _NotJson as e:
            raise DatasetError(f"{where}: invalid JSON array: {e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DatasetError(f"{where}: invalid JSON array: {_decode_error(e)}") from e
        records = [(f"element {i} (0-based) of the JSON array", item) for i, item in enumerate(value)]
        what = "is a {}, not an object"
    else:
        records = []
        for lineno, line in enumerate(data.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"line {lineno}", json.loads(line.decode("utf-8"), object_pairs_hook=_object,
                                                             parse_constant=_no_constant)))
            except _DuplicateKey as e:
                raise DatasetError(f"{where}: line {lineno}: the object repeats the key {e.args[0]!r}") from None
            except _NotJson as e:
                raise DatasetError(f"{where}: line {lineno}: invalid JSON: {e}") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DatasetError(f"{where}: line {lineno}: invalid JSON: {_decode_error(e, in_line=True)}; "
                                   "each line must be one JSON object") from e
        what = "holds a JSON {}, not an object; each line must be one object"
    rows = []
    for at, record in records:
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: {at} {what.format(_json_type(record))}")
        bad = _lone_surrogate(record)
        if bad is not None:
            raise DatasetError(f"{where}: {at}: the string {bad[:40]!r} is not valid Unicode (a lone surrogate escape)")
        rows.append(record)
    return rows


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


def _check_prompt(row: Row, key: str, where: str, index: int, alphabet: str = "") -> None:
    value = row.get(key)
    if value is None:
        raise _missing(row, key, where, index, "prompt_key")
    if not isinstance(value, str):
        raise DatasetError(f"{_row_at(where, index)}: key {key!r} must be a string, got {_json_type(value)} {_short(value)}")
    if not value.strip():
        raise DatasetError(f"{_row_at(where, index)}: key {key!r} is an empty (or whitespace-only) prompt; fix the row")
    if alphabet and not set(value) <= set(alphabet):
        bad = next(c for c in value if c not in alphabet)
        raise DatasetError(
            f"{_row_at(where, index)}: key {key!r} = {_short(value)} has the character {bad!r}, which the tiny policy "
            f"cannot tokenize (it knows {alphabet!r} only); train on such text with an HF model (model.kind = hf, model.path)"
        )


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
