"""Seeded random tests of the user-dataset pipeline: ``elasticrl.data`` (load_rows, split_eval,
RowStream) and ``elasticrl.rl.workload.DatasetRows`` / ``row_source`` (rows -> iterations, resume).

Random datasets (random column names, unicode / long / empty fields, nulls, missing keys,
duplicate ids) are written as JSON lines (blank lines, CRLF), JSON lines in a ``.json`` file, a JSON
array, parquet and ``save_to_disk`` directories, and checked against what the code promises:

* ``load_rows``: "The rows in file order as plain dicts (all columns kept ...) ... a key absent
  from some rows reads as ``None`` there"; a bad row raises ``DatasetError`` whose "message names
  the file, the row and the key" (``row 17 (0-based)``; JSON parse errors name the 1-based line).
* ``RowStream``: "the order of an epoch depends only on (seed, epoch) ...
  ``take(p, a) + take(p + a, b) == take(p, a + b)``", each epoch a permutation of the rows.
* ``DatasetRows``: "a resumed run neither repeats nor skips rows", "changing
  prompts_per_iteration between a run and its resume still neither repeats nor skips rows".
  Rows are not sharded by rank (rank 0 submits every row; ``Submitter.submit``: "every world
  size trains on the same data"), so a resize on resume is modelled as a new prompts_per_iteration.
* ``load_dataset_rows``/config: a bad path, format or column is a ``ConfigError`` naming the field.

Run extra seeds once with ``ELASTICRL_RANDOM_SEEDS=100`` (seeds 0..99).
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import string

import pytest

from elasticrl.config import ConfigError
from elasticrl.data import MAX_ROW_BYTES, MESSAGE_ROLES, DatasetError, RowStream, describe, load_rows, split_eval
from elasticrl.rl.workload import DatasetRows, row_source
from tests.unit.test_data_dataset import raises, write_jsonl
from tests.unit.test_workload import config

pytestmark = pytest.mark.timeout(120)

# No network: like load_rows, switch the hub off before this file's writers first import datasets.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEEDS = list(range(int(os.environ.get("ELASTICRL_RANDOM_SEEDS", "10"))))

COLUMN_POOL = ["prompt", "question", "text", "Prompt", "input text", "préambule", "问题", "a.b", "col_1", "x-y", "q"]
ALPHABET = string.ascii_letters + string.digits + " \t\n\"\\/{}[],:" + "éüß中文😀🚀ありがとう"
FORMATS = ("jsonl", "lines.json", "array.json", "parquet", "saved", "saved_dict")


# --- random data -----------------------------------------------------------------------------------


def rand_text(rng: random.Random, lo: int = 0, hi: int = 30) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(lo, hi)))


def rand_prompt(rng: random.Random) -> str:
    return rand_text(rng, 0, 20) + rng.choice(string.ascii_letters + "中😀") + rand_text(rng, 0, 5)


def rand_messages(rng: random.Random) -> list[dict]:
    return [{"role": rng.choice(MESSAGE_ROLES), "content": rand_text(rng, 0, 15)} for _ in range(rng.randint(1, 3))]


VALUE_KINDS = {
    "int": lambda rng: rng.randint(-10**12, 10**12),
    "float": lambda rng: rng.uniform(-1e6, 1e6),
    "str": lambda rng: rand_text(rng),  # may be ""
    "bool": lambda rng: rng.random() < 0.5,
    "list": lambda rng: [rand_text(rng, 1, 6) for _ in range(rng.randint(0, 3))],
    "dict": lambda rng: {"k": rng.randint(0, 9), "s": rand_text(rng, 0, 5)},
    "id": lambda rng: rng.randint(0, 3),  # duplicate ids on purpose: rows are never de-duplicated
}


def random_dataset(rng: random.Random, mode: str, n: int | None = None) -> tuple[list[dict], str]:
    """(rows with every key present, ``None`` where a row lacks it, key column name). Each row has a
    unique ``"uid"`` so the tests can follow it; the key column is always valid."""
    n = n if n is not None else rng.randint(1, 25)
    key = rng.choice(COLUMN_POOL) if mode != "none" else ""
    extras = {f"{rng.choice(COLUMN_POOL)}_{i}": rng.choice(sorted(VALUE_KINDS)) for i in range(rng.randint(0, 4))}
    rows = []
    for uid in range(n):
        row: dict = {"uid": uid}
        if mode == "prompt":
            row[key] = rand_prompt(rng)
        elif mode == "messages":
            row[key] = rand_messages(rng)
        for column, kind in extras.items():
            r = rng.random()
            if r < 0.15:
                continue  # missing: reads as None
            row[column] = None if r < 0.25 else VALUE_KINDS[kind](rng)
        if rng.random() < 0.15:  # a long field, the row still under the size limit
            row["long"] = "".join(rng.choice("ab中😀 ") for _ in range(rng.randint(1000, 8000)))
        rows.append(row)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return [{c: row.get(c) for c in columns} for row in rows], key


def sparse(rng: random.Random, rows: list[dict]) -> list[dict]:
    """The same rows as JSON objects that leave out some null keys (Arrow reads them back as None)."""
    # The first row keeps every key: a column null everywhere and never written would not exist.
    return rows[:1] + [{k: v for k, v in row.items() if v is not None or rng.random() < 0.5} for row in rows[1:]]


def write_dataset(rng: random.Random, directory: pathlib.Path, fmt: str, rows: list[dict], name: str = "") -> pathlib.Path:
    """``rows`` written as ``fmt``; JSON formats get random blank lines, CRLF, escapes and indents."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    stem = name or f"data {rng.randint(0, 999)} ü"
    if fmt in ("jsonl", "lines.json"):
        path = directory / f"{stem}.{fmt}"
        ascii_only, newline = rng.random() < 0.5, rng.choice(["\n", "\r\n"])
        lines = []
        for row in sparse(rng, rows):
            lines.extend(rng.choice(["", "  ", "\t"]) for _ in range(rng.choice([0, 0, 0, 1, 2])))
            lines.append(json.dumps(row, ensure_ascii=ascii_only))
        path.write_bytes((newline.join(lines) + rng.choice(["", newline, newline * 2])).encode())
        return path
    if fmt == "array.json":
        path = directory / f"{stem}.json"
        path.write_text(json.dumps(sparse(rng, rows), indent=rng.choice([None, 1, 2]), ensure_ascii=rng.random() < 0.5))
        return path
    table = pa.Table.from_pylist(rows)
    if fmt == "parquet":
        path = directory / f"{stem}.parquet"
        pq.write_table(table, str(path))
        return path
    path = directory / stem
    ds = datasets.Dataset(table)
    if fmt == "saved":
        ds.save_to_disk(str(path))
    else:
        datasets.DatasetDict({"test": ds.select([0]), "train": ds}).save_to_disk(str(path))
    return path


def same_rows(got: list[dict], rows: list[dict], fmt: str) -> bool:
    return got == rows


def load_kwargs(mode: str, key: str) -> dict:
    return {"prompt": {"prompt_key": key}, "messages": {"messages_key": key}, "none": {}}[mode]


# --- loading: every format reads back the same rows ---------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_random_dataset_reads_back_identically_in_every_format(seed, tmp_path):
    rng = random.Random(seed)
    mode = rng.choice(["prompt", "prompt", "messages", "none"])
    rows, key = random_dataset(rng, mode)
    for fmt in FORMATS:
        path = write_dataset(rng, tmp_path / fmt, fmt, rows)
        got = load_rows(path, **load_kwargs(mode, key))
        assert same_rows(got, rows, fmt), f"seed {seed}: {fmt} rows differ"
        assert [type(r["uid"]) for r in got] == [int] * len(rows)
        json.dumps(got)  # plain JSON-able values
        assert describe(path).startswith(f"{path}: {len(rows)} rows, keys ")


# --- loading: a bad row is named by file, row and key -------------------------------------------


PROMPT_DEFECTS = [  # (new value or "DROP", typed-column safe, words the message must hold)
    ("DROP", True, ["has no key", "prompt_key"]),
    (None, True, ["has no key", "(or it is null)"]),
    ("", True, ["empty"]),
    (" \t\n ", True, ["empty"]),
    (7, False, ["must be a string", "number 7"]),
    (2.5, False, ["must be a string", "number"]),
    (True, False, ["must be a string", "boolean"]),
    (["a"], False, ["must be a string", "list"]),
    ({"text": "a"}, False, ["must be a string"]),
]
MESSAGE_DEFECTS = [
    ("DROP", True, ["has no key", "messages_key"]),
    (None, True, ["has no key"]),
    ([], True, ["empty list"]),
    ([{"role": "robot", "content": "x"}], True, ["message 0 has role 'robot'"]),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": None}], True, ["message 1 has content None"]),
    ([{"role": None, "content": "a"}], True, ["message 0 has role None"]),
    ("hello", False, ["must be a list of chat messages", "string"]),
    ([{"role": "user", "content": 3}], False, ["message 0 has content 3"]),
    (["hi"], False, ["message 0 is a string"]),
    ({"role": "user"}, False, ["must be a list"]),
]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_bad_rows_are_named_by_file_row_and_key(seed, tmp_path):
    rng = random.Random(1000 + seed)
    defects = [("prompt", d) for d in PROMPT_DEFECTS] + [("messages", d) for d in MESSAGE_DEFECTS]
    for case in range(4):  # 10 seeds x 4 cases visit every defect twice
        mode, (value, typed_safe, words) = defects[(4 * seed + case) % len(defects)]
        rows, key = random_dataset(rng, mode, n=rng.randint(1, 15))
        fmt = rng.choice(FORMATS if typed_safe else FORMATS[:3])
        bad = sorted(rng.sample(range(len(rows)), rng.randint(1, min(2, len(rows)))))
        for k in bad:  # the first bad row is the one named
            # A dropped key is a null in a typed column and left out of a JSON object (sparse()).
            rows[k][key] = None if value == "DROP" else value
        path = write_dataset(rng, tmp_path / f"c{case}", fmt, rows, name=f"bad{case}")
        message = raises([path.name, f"row {bad[0]} (0-based)", repr(key), *words], load_rows, path, **load_kwargs(mode, key))
        assert "Traceback" not in message, f"seed {seed} case {case}"


@pytest.mark.parametrize("seed", SEEDS)
def test_random_oversized_row_is_named(seed, tmp_path):
    rng = random.Random(2000 + seed)
    rows, key = random_dataset(rng, "prompt", n=rng.randint(1, 8))
    k = rng.randrange(len(rows))
    # Non-ASCII counts as its \\u escapes: the size is json.dumps(row) with the defaults.
    filler = rng.choice(["x", "é", "😀"])
    rows[k]["blob"] = filler * (MAX_ROW_BYTES // len(json.dumps(filler).strip('"')) + 1)
    for row in rows:
        row.setdefault("blob", None)
    fmt = rng.choice(FORMATS)
    path = write_dataset(rng, tmp_path, fmt, rows, name="big")
    raises([path.name, f"row {k} (0-based) is", f"over the limit of {MAX_ROW_BYTES} bytes"], load_rows, path, prompt_key=key)
    # Just under the limit reads fine.
    rows[k]["blob"] = ""
    rows[k]["blob"] = "x" * (MAX_ROW_BYTES - len(json.dumps(rows[k])))
    assert len(json.dumps(rows[k])) == MAX_ROW_BYTES
    path = write_dataset(rng, tmp_path / "ok", fmt, rows, name="fits")
    assert same_rows(load_rows(path, prompt_key=key), rows, fmt)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_json_parse_errors_name_the_file_line(seed, tmp_path):
    rng = random.Random(3000 + seed)
    n = rng.randint(1, 12)
    lines = []
    for i in range(n):
        lines.extend("" for _ in range(rng.choice([0, 0, 1, 2])))
        lines.append(json.dumps({"prompt": f"p{i}", "x": rand_text(rng)}, ensure_ascii=rng.random() < 0.5))
    at = rng.randint(0, len(lines))
    broken, words = rng.choice([
        ('{"prompt": oops}', ["invalid JSON", "each line must be one JSON object"]),
        ('{"prompt": "a",}', ["invalid JSON"]),
        ('{"prompt": "a"', ["invalid JSON"]),
        ("[1, 2]", ["holds a JSON list, not an object"]),
        ('"just text"', ["holds a JSON string, not an object"]),
        ("42", ["holds a JSON number, not an object"]),
    ])
    lines.insert(at, broken)
    path = tmp_path / f"broken{seed}.{rng.choice(['jsonl', 'json'])}"
    if broken.startswith("[") and not any(lines[:at]):
        # A file that starts with "[" is read as one JSON array.
        words = ["invalid JSON array"]
    path.write_text("\n".join(lines) + "\n")
    expected = [path.name, *words] + ([] if words == ["invalid JSON array"] else [f"line {at + 1}"])
    raises(expected, load_rows, path, prompt_key="prompt")


# --- the row stream: deterministic, every row once per epoch, resumable -----------------------------


def uids(pairs) -> list[int]:
    return [row["uid"] for _, row in pairs]


def reference(rows: list[dict], seed: int, shuffle: bool, start: int, count: int) -> list[int]:
    """Row uids at global positions start.. computed from scratch (fresh streams, no caches)."""
    n = len(rows)
    out = []
    for p in range(start, start + count):
        order = RowStream(rows, seed, shuffle=shuffle).epoch_order(p // n)
        out.append(rows[order[p % n]]["uid"])
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_random_row_stream_is_a_pure_function_of_seed_and_position(seed):
    rng = random.Random(4000 + seed)
    rows, _ = random_dataset(rng, "prompt", n=rng.randint(1, 17))
    n, data_seed, shuffle = len(rows), rng.randint(0, 10**6), rng.random() < 0.8
    stream = RowStream(rows, data_seed, shuffle=shuffle)
    epochs = rng.randint(2, 6)
    for epoch in range(epochs):  # every row exactly once per epoch, duplicate ids and all
        order = stream.epoch_order(epoch)
        assert sorted(order) == list(range(n))
        assert sorted(uids(stream.take(epoch * n, n))) == list(range(n))
        if not shuffle:
            assert order == list(range(n))
    for _ in range(15):  # random access in random order (exercises the 2-epoch cache), across epochs
        p, count = rng.randint(0, epochs * n), rng.randint(0, 3 * n + 2)
        got = stream.take(p, count)
        assert [q for q, _ in got] == list(range(p, p + count))
        assert uids(got) == reference(rows, data_seed, shuffle, p, count)
        cut = rng.randint(0, count)
        assert stream.take(p, cut) + RowStream(rows, data_seed, shuffle=shuffle).take(p + cut, count - cut) == got
        assert stream.epoch_of(p) == p // n


@pytest.mark.parametrize("seed", SEEDS)
def test_random_crashes_and_resumes_neither_repeat_nor_skip_rows(seed):
    rng = random.Random(5000 + seed)
    rows, _ = random_dataset(rng, "prompt", n=rng.randint(1, 13))
    n, data_seed, shuffle = len(rows), rng.randint(0, 10**6), rng.random() < 0.8
    held_out = [{"prompt": "held"}]
    per_iteration = rng.randint(1, 2 * n + 3)

    # Uninterrupted: iteration i trains on positions (i-1)*p .. i*p-1, crossing epochs.
    plain = DatasetRows(rows, held_out, seed=data_seed, per_iteration=per_iteration, shuffle=shuffle)
    for i in range(1, 8):
        assert [r["uid"] for r in plain.train_rows(i, per_iteration)] == reference(
            rows, data_seed, shuffle, (i - 1) * per_iteration, per_iteration)

    # Crash at random points, resume from a random earlier checkpoint (JSON, as saved), maybe in a
    # new process, maybe with another prompts_per_iteration: the rows used are one unbroken stream.
    source = DatasetRows(rows, held_out, seed=data_seed, per_iteration=per_iteration, shuffle=shuffle)
    consumed: list[int] = []
    checkpoints: dict[int, tuple[dict, int] | None] = {0: None}  # iteration -> (position, rows consumed)
    iteration, history = 0, []
    for _ in range(rng.randint(5, 30)):
        iteration += 1
        got = source.train_rows(iteration, source.per_iteration)
        assert len(got) == source.per_iteration
        assert source.train_rows(iteration, source.per_iteration) == got  # a re-submit is the same
        consumed += [r["uid"] for r in got]
        position = json.loads(json.dumps(source.position(iteration)))
        assert position["next_iteration"] == iteration + 1
        assert position["next_row"] == len(consumed)
        assert (position["epoch"], position["rows_per_epoch"]) == (len(consumed) // n, n)
        if rng.random() < 0.6:
            checkpoints[iteration] = (position, len(consumed))
        if rng.random() < 0.3:  # crash; the newest checkpoint (or an older one) survives
            back = rng.choice(sorted(checkpoints)[-2:])
            checkpoints = {j: c for j, c in checkpoints.items() if j <= back}
            consumed = consumed[:checkpoints[back][1] if back else 0]
            new_per = rng.choice([source.per_iteration, rng.randint(1, 2 * n + 3)])
            if rng.random() < 0.7 or not back:  # a new process (in place from nothing: see test_starting_over_in_place_...)
                source = DatasetRows(rows, held_out, seed=data_seed, per_iteration=new_per, shuffle=shuffle)
            else:  # re-formed in place: the same object resumes
                source.per_iteration = new_per
            if back:  # like NodeTrainer._resume: resume() only when a checkpoint or snapshot was found
                source.resume(back, checkpoints[back][0])
            iteration = back
            history.append((back, new_per))
    assert consumed == reference(rows, data_seed, shuffle, 0, len(consumed)), f"seed {seed}: crashes {history}"
    full_epochs = len(consumed) // n
    for e in range(full_epochs):
        assert sorted(consumed[e * n:(e + 1) * n]) == list(range(n))
    assert source.eval_rows(5) == held_out


# --- config: dataset runs end to end, and bad settings name the field --------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_random_dataset_run_splits_and_visits_every_train_row_each_epoch(seed, tmp_path):
    rng = random.Random(6000 + seed)
    mode = rng.choice(["prompt", "messages"])
    rows, key = random_dataset(rng, mode, n=rng.randint(2, 20))
    path = write_dataset(rng, tmp_path, rng.choice(FORMATS), rows, name="train")
    fraction = rng.choice([0.0, 0.0, 0.1, 0.3, 0.5])
    run_seed, per_iteration, shuffle = rng.randint(0, 999), rng.randint(1, 7), rng.random() < 0.8
    overrides = ["--task.kind=dataset", f"--task.path={path}", "--trainer.warmup_steps=0", f"--run.seed={run_seed}",
                 f"--task.prompts_per_iteration={per_iteration}", f"--task.eval_fraction={fraction}",
                 f"--task.shuffle={str(shuffle).lower()}"]
    overrides += [f"--task.prompt_key={key}"] if mode == "prompt" else [f"--task.messages_key={key}", "--task.chat_template=true"]
    overrides += HF  # any text: the tiny policy's vocabulary would refuse most random prompts
    source = row_source(config(*overrides), None)
    assert isinstance(source, DatasetRows)
    train, held = split_eval(rows, fraction, run_seed)
    assert [r["uid"] for r in source.eval_rows(10**6)] == [r["uid"] for r in held]
    train_ids, held_ids = {r["uid"] for r in train}, {r["uid"] for r in held}
    assert not train_ids & held_ids and train_ids | held_ids == {r["uid"] for r in rows}
    m = len(train)
    iterations = (3 * m) // per_iteration + 1
    seen = [r["uid"] for i in range(1, iterations + 1) for r in source.train_rows(i, per_iteration)]
    for e in range(len(seen) // m):
        assert sorted(seen[e * m:(e + 1) * m]) == sorted(train_ids)
    assert seen == reference(train, run_seed, shuffle, 0, len(seen))


# An HF model named, never loaded (rows are read and checked without it); the chat template lets
# task.messages_key give chat messages.
HF = ["--model.kind=hf", "--model.path=m"]


def bad_setting(rng: random.Random, tmp_path: pathlib.Path) -> tuple[list[str], list[str]]:
    """(overrides, words the ConfigError must hold) for one random mistake."""
    base = ["--task.kind=dataset", "--trainer.warmup_steps=0", *HF, "--task.chat_template=true"]
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}])
    name = rand_text(random.Random(rng.random()), 1, 8).strip().replace("/", "_").replace("\\", "_") or "x"
    name = "".join(c for c in name if c.isprintable() and c not in "\"{}[],:\t\n") or "x"
    kind = rng.choice(["missing", "extension", "prompt_key", "messages_key", "eval_path", "not_parquet", "not_saved",
                       "no_path", "fraction", "both_eval", "no_key", "split_empty"])
    if kind == "missing":
        ext = rng.choice([".jsonl", ".json", ".parquet", ""])
        return base + [f"--task.path={tmp_path}/nope {name}{ext}"], ["task.path=", "no such file or directory", f"nope {name}"]
    if kind == "extension":
        ext = rng.choice([".csv", ".tsv", ".txt", ".jsonl.gz", ".arrow", ""])
        path = tmp_path / f"data{ext}"
        path.write_text('{"prompt": "a"}\n')
        return base + [f"--task.path={path}"], ["task.path=", "unknown data file type", ".jsonl, .json or .parquet"]
    if kind == "prompt_key":
        return base + [f"--task.path={good}", f"--task.prompt_key=nope{name}"], \
            ["task.path=", "good.jsonl", "row 0 (0-based)", f"'nope{name}'", "prompt, answer", "prompt_key"]
    if kind == "messages_key":
        return base + [f"--task.path={good}", f"--task.messages_key=nope{name}"], \
            ["task.path=", "row 0 (0-based)", f"'nope{name}'", "messages_key"]
    if kind == "eval_path":
        return base + [f"--task.path={good}", f"--task.eval_path={tmp_path}/held {name}.jsonl"], \
            ["task.eval_path=", "no such file or directory"]
    if kind == "not_parquet":
        path = tmp_path / "fake.parquet"
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))))
        return base + [f"--task.path={path}"], ["task.path=", "fake.parquet", "parquet"]
    if kind == "not_saved":
        (tmp_path / "plain dir").mkdir()
        return base + [f"--task.path={tmp_path / 'plain dir'}"], ["task.path=", "save_to_disk"]
    if kind == "no_path":
        return base, ["task.path: task.kind = dataset needs the data file"]
    if kind == "fraction":
        value = rng.choice([-0.5, 1.0, 1.5, 7])
        return base + [f"--task.path={good}", f"--task.eval_fraction={value}"], ["task.eval_fraction:", "must be in [0, 1)"]
    if kind == "both_eval":
        return base + [f"--task.path={good}", f"--task.eval_path={good}", "--task.eval_fraction=0.1"], \
            ["task.eval_fraction: set either task.eval_path"]
    if kind == "no_key":
        return base + [f"--task.path={good}", "--task.prompt_key="], ["task.prompt_key: empty"]
    return base + [f"--task.path={good}", "--task.eval_fraction=0.9"], ["eval fraction 0.9 of 2 rows", "no training rows"]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_bad_dataset_settings_fail_at_start_naming_the_field(seed, tmp_path):
    rng = random.Random(7000 + seed)
    for case in range(4):
        (tmp_path / f"c{case}").mkdir()
        overrides, words = bad_setting(rng, tmp_path / f"c{case}")
        with pytest.raises(ConfigError) as info:
            row_source(config(*overrides), None)  # config time, or load time before any training
        for word in words:
            assert word in str(info.value), f"seed {seed}: {word!r} not in {str(info.value)!r}"


# --- bugs found by the random cases (minimized) ------------------------------------------------------


def _large_jsonl(path: pathlib.Path, tail: list[str], rows: int = 220) -> pathlib.Path:
    """``rows`` valid ~50 KB rows (11 MB: more than the 10 MB chunk datasets reads the schema from), then ``tail``."""
    pad = "x" * 50_000
    head = "".join(json.dumps({"prompt": f"p{i}", "pad": pad, "opt": None}) + "\n" for i in range(rows))
    path.write_text(head + "".join(line + "\n" for line in tail))
    return path


@pytest.mark.parametrize("tail", [{"prompt": "z", "extra": 1}, {"prompt": "z", "opt": "now a string"}])
def test_valid_jsonl_with_a_column_first_filled_after_10_mb_loads(tmp_path, tail):
    path = _large_jsonl(tmp_path / "big.jsonl", [json.dumps(tail)])
    rows = load_rows(path, prompt_key="prompt")  # today: DatasetError "... CastError ... column names don't match"
    assert len(rows) == 221 and {k: rows[-1][k] for k in tail} == tail


@pytest.mark.parametrize("bad", ['{"prompt": "a", "prompt": "b"}', '{"prompt": "a\\ud800"}'])
def test_arrow_parse_error_in_a_large_file_names_the_right_line(tmp_path, bad):
    path = _large_jsonl(tmp_path / "big.jsonl", [bad])
    with pytest.raises(DatasetError) as info:
        load_rows(path, prompt_key="prompt")
    assert "line 221" in str(info.value) or "row 220 (0-based)" in str(info.value), str(info.value)


def test_json_array_keeps_float_digits(tmp_path):
    values = [3.141592653589793, 0.00001234567, 215387.30508275027]  # the last from seed 0
    path = tmp_path / "floats.json"
    path.write_text(json.dumps([{"prompt": "a", "x": v} for v in values]))
    assert [r["x"] for r in load_rows(path, prompt_key="prompt")] == values


def test_null_line_is_refused_not_read_as_a_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\nnull\n{"a": 2}\n')  # from test_random_json_parse_errors_name_the_file_line[9]
    raises(["rows.jsonl", "line 2", "holds a JSON null, not an object"], load_rows, path)  # today: 3 rows, one all None


def test_json_looking_strings_keep_their_type_in_a_mixed_type_column(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": 3},
                                                   {"prompt": "c", "answer": "null"}, {"prompt": "d", "answer": "true"}])
    assert [r["answer"] for r in load_rows(path, prompt_key="prompt")] == ["1", 3, "null", "true"]  # today: [1, 3, None, True]


def test_bad_message_content_blames_the_right_row(tmp_path):
    # Minimized from test_random_bad_rows_are_named_by_file_row_and_key[12] (blamed row 2, bad row 5).
    path = write_jsonl(tmp_path / "chat.jsonl", [{"m": [{"role": "user", "content": "1"}]},
                                                 {"m": [{"role": "user", "content": 3}]}])
    raises(["chat.jsonl", "row 1 (0-based)", "message 0 has content 3"], load_rows, path, messages_key="m")


def test_starting_over_in_place_after_a_resume_with_another_batch_size_starts_at_row_0():
    # Minimized from test_random_crashes_and_resumes_neither_repeat_nor_skip_rows[72] with the
    # in-place re-form from nothing that NodeTrainer._reform does when no rank holds a checkpoint.
    data = [{"prompt": f"p{i}"} for i in range(10)]
    rows = DatasetRows(data, [], seed=0, per_iteration=6)
    rows.resume(10, {"next_iteration": 11, "next_row": 40})  # checkpoint 10 of a run with 4 per iteration
    # ... the lost node held the only checkpoint: the survivors start over on the same object.
    assert rows.train_rows(1, 6) == DatasetRows(data, [], seed=0, per_iteration=6).train_rows(1, 6)


def test_integer_beyond_int64_is_kept_or_refused(tmp_path):
    path = write_jsonl(tmp_path / "ids.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 2**64 - 1}])
    try:
        rows = load_rows(path, prompt_key="prompt")
    except DatasetError as e:
        assert "row 1 (0-based)" in str(e) and "'id'" in str(e)
    else:
        assert rows[1]["id"] == 2**64 - 1 and type(rows[0]["id"]) is int


def test_rows_of_empty_objects_name_the_missing_key(tmp_path):
    path = write_jsonl(tmp_path / "empty_rows.jsonl", [{}, {}])
    raises(["empty_rows.jsonl", "row 0 (0-based)", "'prompt'"], load_rows, path, prompt_key="prompt")
