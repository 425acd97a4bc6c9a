"""elasticrl.data.dataset: reading local data files, row validation, eval split and RowStream."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from elasticrl.data import MAX_ROW_BYTES, DatasetError, RowStream, describe, load_rows, split_eval

pytestmark = pytest.mark.timeout(120)

ROWS = [
    {"prompt": "2+2=", "answer": 4, "score": 0.5, "tags": ["math", "easy"], "meta": {"src": "gen", "level": 1}},
    {"prompt": "3+5=", "answer": 8, "score": 1.5, "tags": ["math"], "meta": {"src": "gen", "level": 2}},
    {"prompt": "capital of France?", "answer": 7, "score": 2.25, "tags": [], "meta": {"src": "web", "level": 3}},
]
CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], "id": 1},
    {"messages": [{"role": "user", "content": "2+2?"}], "id": 2},
]


def write_jsonl(path: pathlib.Path, rows: list, blank_lines: bool = False) -> pathlib.Path:
    sep = "\n\n" if blank_lines else "\n"
    path.write_text(sep.join(json.dumps(r) for r in rows) + "\n")
    return path


def write_lines(path: pathlib.Path, lines: list[str]) -> pathlib.Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def raises(match_all: list[str], fn, *args, **kwargs) -> str:
    with pytest.raises(DatasetError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    for part in match_all:
        assert part in message, f"{part!r} not in {message!r}"
    return message


# --- formats --------------------------------------------------------------------------------------


def test_jsonl_keeps_extra_columns_with_python_types(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    rows = load_rows(str(path), prompt_key="prompt")
    assert rows == ROWS
    first = rows[0]
    assert type(first["answer"]) is int and type(first["score"]) is float
    assert type(first["tags"]) is list and type(first["meta"]) is dict and type(first["meta"]["level"]) is int
    json.dumps(rows)


def test_json_array_and_json_lines_in_a_json_file(tmp_path):
    array = tmp_path / "train.json"
    array.write_text(json.dumps(ROWS, indent=2))
    assert load_rows(array, prompt_key="prompt") == ROWS
    lines = write_jsonl(tmp_path / "lines.json", ROWS)
    assert load_rows(lines, prompt_key="prompt") == ROWS


def test_parquet(tmp_path):
    import datasets

    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    assert load_rows(path, prompt_key="prompt") == ROWS


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "single"))
    assert load_rows(tmp_path / "single", prompt_key="prompt") == ROWS
    other = datasets.Dataset.from_list(ROWS[:1])
    datasets.DatasetDict({"test": other, "train": ds}).save_to_disk(str(tmp_path / "dd"))
    assert load_rows(tmp_path / "dd", prompt_key="prompt") == ROWS


def test_dataset_dict_without_train_split_names_the_splits(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"validation": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    raises(["dd", "'train'", "validation", "test"], load_rows, tmp_path / "dd", prompt_key="prompt")


def test_messages_key(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    rows = load_rows(path, messages_key="messages")
    assert [r["id"] for r in rows] == [1, 2]
    assert rows[0]["messages"][1] == {"role": "user", "content": "hi"}


def test_blank_lines_are_skipped_and_rows_count_records(tmp_path):
    rows = [{"prompt": "a"}, {"prompt": "b"}, {"prompt": 3}]
    path = write_jsonl(tmp_path / "gaps.jsonl", rows, blank_lines=True)
    # The bad row is on line 5 of the file but is record 2 (0-based).
    raises(["gaps.jsonl", "row 2 (0-based)", "'prompt'"], load_rows, path, prompt_key="prompt")


def test_no_cache_files_next_to_the_data_and_loading_twice_works(tmp_path):
    import datasets

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_jsonl(data_dir / "train.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS).to_parquet(str(data_dir / "train.parquet"))
    before = sorted(os.listdir(data_dir))
    for _ in range(2):
        assert load_rows(data_dir / "train.jsonl", prompt_key="prompt") == ROWS
        assert load_rows(data_dir / "train.parquet", prompt_key="prompt") == ROWS
    assert sorted(os.listdir(data_dir)) == before
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    saved_before = sorted(os.listdir(tmp_path / "saved"))
    load_rows(tmp_path / "saved", prompt_key="prompt")
    assert sorted(os.listdir(tmp_path / "saved")) == saved_before


def test_describe(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    line = describe(path)
    assert "train.jsonl: 3 rows" in line and "prompt" in line and "answer" in line


# --- argument and file errors --------------------------------------------------------------------


def test_at_most_one_key(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    raises(["prompt_key", "messages_key"], load_rows, path, prompt_key="prompt", messages_key="messages")


def test_no_key_reads_the_rows_unchecked(tmp_path):
    """An environment's rows need no prompt: without a key the rows are only read."""
    path = write_jsonl(tmp_path / "train.jsonl", [{"question": "q", "answer": 3}, {"question": "r"}])
    assert load_rows(path) == [{"question": "q", "answer": 3}, {"question": "r", "answer": None}]


def test_missing_file_names_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raises([str(tmp_path / "nope.jsonl"), "task.path"], load_rows, "nope.jsonl", prompt_key="prompt")
    raises(["data.path=nope.jsonl"], load_rows, "nope.jsonl", prompt_key="prompt", what="data.path")


def test_unknown_extension(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("prompt\nhi\n")
    raises(["train.csv", "'.csv'", ".jsonl"], load_rows, path, prompt_key="prompt")


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_file(tmp_path, text):
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    raises(["empty.jsonl", "empty"], load_rows, path, prompt_key="prompt")


def test_empty_array_and_empty_saved_dataset(tmp_path):
    import datasets

    path = tmp_path / "empty.json"
    path.write_text("[]")
    raises(["empty.json"], load_rows, path, prompt_key="prompt")
    datasets.Dataset.from_dict({"prompt": []}).save_to_disk(str(tmp_path / "saved"))
    raises(["saved", "at least one row"], load_rows, tmp_path / "saved", prompt_key="prompt")


def test_bad_json_line_is_located(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "a"}', '{"prompt": "b"}', '{"prompt": oops}', '{"prompt": "d"}'])
    message = raises(["bad.jsonl", "line 3:", "column 12", "invalid JSON"], load_rows, path, prompt_key="prompt")
    assert "Expecting value" in message


def test_mixed_types_with_blank_lines_are_read(tmp_path):
    # datasets alone fails on this valid file (mixed-type column plus a trailing blank line).
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": "two"}\n\n')
    assert [r["answer"] for r in load_rows(path, prompt_key="prompt")] == [1, "two"]
    array = tmp_path / "mixed.json"
    array.write_text('[{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": "two"}]')
    assert [r["answer"] for r in load_rows(array, prompt_key="prompt")] == [1, "two"]


def test_not_utf8_line_is_located(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    raises(["latin.jsonl", "line 2", "UTF-8"], load_rows, path, prompt_key="prompt")


def test_non_object_line_is_located(tmp_path):
    path = write_lines(tmp_path / "list.jsonl", ['{"prompt": "a"}', "[1, 2]"])
    raises(["list.jsonl", "line 2", "list", "not an object"], load_rows, path, prompt_key="prompt")


def test_bad_json_array(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"prompt": "a"},\n  {"prompt": }\n]\n')
    raises(["bad.json", "line 3"], load_rows, path, prompt_key="prompt")
    path.write_text('[{"prompt": "a"}, "b"]')
    raises(["bad.json", "element 1 (0-based)", "string"], load_rows, path, prompt_key="prompt")


def test_not_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_text("this is not parquet at all\n")
    raises(["train.parquet", "parquet"], load_rows, path, prompt_key="prompt")


def test_directory_not_saved_by_datasets(tmp_path):
    (tmp_path / "dir").mkdir()
    raises(["dir", "save_to_disk"], load_rows, tmp_path / "dir", prompt_key="prompt")


def test_mixed_types_across_rows_are_read(tmp_path):
    # pyarrow alone would reject an int column that later holds a string; datasets keeps both.
    path = write_lines(tmp_path / "mixed.jsonl", ['{"prompt": "a", "answer": 1}', '{"prompt": "b", "answer": "two"}'])
    assert [r["answer"] for r in load_rows(path, prompt_key="prompt")] == [1, "two"]


def test_datasets_missing_says_how_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    assert load_rows(write_jsonl(tmp_path / "train.jsonl", ROWS), prompt_key="prompt") == ROWS  # json: no datasets
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")  # only the import is reached
    raises(["pip install", "elasticrl[data]"], load_rows, path, prompt_key="prompt")


# --- row validation -------------------------------------------------------------------------------


def test_missing_prompt_key_lists_row_keys(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a"}, {"question": "b", "answer": 1}])
    raises(["train.jsonl", "row 1 (0-based)", "'prompt'", "question", "answer"], load_rows, path, prompt_key="prompt")
    raises(["train.jsonl", "row 0 (0-based)", "'text'", "prompt"], load_rows, path, prompt_key="text")


@pytest.mark.parametrize(
    "bad, expect",
    [({"prompt": 5}, "number"), ({"prompt": ["a"]}, "list"), ({"prompt": ""}, "empty"), ({"prompt": "  "}, "empty")],
)
def test_bad_prompt(tmp_path, bad, expect):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "ok"}, {"prompt": "ok"}, bad])
    raises(["train.jsonl", "row 2 (0-based)", "'prompt'", expect], load_rows, path, prompt_key="prompt")


@pytest.mark.parametrize(
    "messages, expect",
    [
        ("hello", "must be a list"),
        ([], "empty list"),
        ([{"role": "user", "content": "a"}, "hi"], "message 1 is a string"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "message 1 has role 'robot'"),
        ([{"content": "a"}], "message 0 has role None"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}], "message 1 has content 3"),
        ([{"role": "user"}], "message 0 has content None"),
    ],
)
def test_bad_messages(tmp_path, messages, expect):
    path = write_jsonl(tmp_path / "chat.jsonl", [CHATS[0], {"messages": messages}])
    raises(["chat.jsonl", "row 1 (0-based)", "'messages'", expect], load_rows, path, messages_key="messages")


def test_missing_messages_key(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [CHATS[0], {"id": 3}])
    raises(["chat.jsonl", "row 1 (0-based)", "'messages'", "id"], load_rows, path, messages_key="messages")


def test_row_too_large(tmp_path):
    big = "x" * (MAX_ROW_BYTES + 10)
    path = write_jsonl(tmp_path / "big.jsonl", [{"prompt": "a"}, {"prompt": "b", "doc": big}])
    raises(["big.jsonl", "row 1 (0-based)", str(MAX_ROW_BYTES), "bytes"], load_rows, path, prompt_key="prompt")
    fits = write_jsonl(tmp_path / "fits.jsonl", [{"prompt": "b", "doc": "x" * (MAX_ROW_BYTES - 100)}])
    assert len(load_rows(fits, prompt_key="prompt")) == 1


def test_row_not_json_serializable(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "blob": [b"x", b"y"]}), str(path))
    raises(["odd.parquet", "row 0 (0-based)", "'blob'", "JSON-serializable"], load_rows, path, prompt_key="prompt")


# --- split_eval -----------------------------------------------------------------------------------

NUMBERED = [{"prompt": f"p{i}", "i": i} for i in range(20)]


def test_split_eval_is_deterministic_disjoint_and_ordered():
    train, evals = split_eval(NUMBERED, 0.25, seed=3)
    assert len(evals) == 5 and len(train) == 15
    assert (train, evals) == split_eval(NUMBERED, 0.25, seed=3)
    assert split_eval(NUMBERED, 0.25, seed=4)[1] != evals
    ids_train, ids_eval = [r["i"] for r in train], [r["i"] for r in evals]
    assert not set(ids_train) & set(ids_eval)
    assert sorted(ids_train + ids_eval) == list(range(20))
    assert ids_train == sorted(ids_train) and ids_eval == sorted(ids_eval)


def test_split_eval_bounds():
    assert split_eval(NUMBERED, 0.0, seed=0) == (NUMBERED, [])
    assert len(split_eval(NUMBERED, 0.001, seed=0)[1]) == 1  # at least one eval row
    assert len(split_eval(NUMBERED[:2], 0.5, seed=0)[0]) == 1
    for fraction in (-0.1, 1.0, 1.5):
        with pytest.raises(DatasetError, match=r"\[0, 1\)"):
            split_eval(NUMBERED, fraction, seed=0)
    with pytest.raises(DatasetError, match="no training rows"):
        split_eval(NUMBERED[:1], 0.5, seed=0)
    with pytest.raises(DatasetError, match="no training rows"):
        split_eval(NUMBERED[:3], 0.9, seed=0)


# --- RowStream ------------------------------------------------------------------------------------


def test_row_stream_epochs_are_distinct_permutations():
    stream = RowStream(NUMBERED, seed=7)
    assert len(stream) == 20
    orders = [stream.epoch_order(e) for e in range(4)]
    for order in orders:
        assert sorted(order) == list(range(20))
    assert len({tuple(o) for o in orders}) == 4
    epoch1 = stream.take(20, 20)
    assert [p for p, _ in epoch1] == list(range(20, 40))
    assert [row["i"] for _, row in epoch1] == orders[1]
    assert stream.epoch_of(19) == 0 and stream.epoch_of(20) == 1 and stream.epoch_of(45) == 2


def test_row_stream_take_crosses_epochs_and_resumes_exactly():
    stream = RowStream(NUMBERED, seed=1)
    whole = stream.take(13, 30)
    o0, o1, o2 = (stream.epoch_order(e) for e in range(3))
    assert [row["i"] for _, row in whole] == o0[13:] + o1 + o2[:3]
    for split in range(31):
        resumed = RowStream(NUMBERED, seed=1)  # a fresh process resuming at a saved position
        assert stream.take(13, split) + resumed.take(13 + split, 30 - split) == whole
    assert stream.take(5, 0) == []


def test_row_stream_deterministic_and_unshuffled():
    a, b = RowStream(NUMBERED, seed=9), RowStream(NUMBERED, seed=9)
    assert a.take(0, 50) == b.take(0, 50)
    assert RowStream(NUMBERED, seed=10).epoch_order(0) != a.epoch_order(0)
    plain = RowStream(NUMBERED, seed=9, shuffle=False)
    assert [row["i"] for _, row in plain.take(15, 10)] == list(range(15, 20)) + list(range(5))
    assert plain.epoch_order(3) == list(range(20))


def test_row_stream_cache_survives_revisiting_old_epochs():
    stream = RowStream(NUMBERED, seed=2)
    first = stream.epoch_order(0)
    for epoch in range(1, 6):
        stream.epoch_order(epoch)
    assert stream.epoch_order(0) == first
    stream.epoch_order(0).reverse()  # callers get a copy
    assert stream.epoch_order(0) == first


def test_row_stream_rejects_bad_arguments():
    with pytest.raises(DatasetError, match="empty"):
        RowStream([], seed=0)
    stream = RowStream(NUMBERED, seed=0)
    with pytest.raises(DatasetError, match="position"):
        stream.take(-1, 2)
    with pytest.raises(DatasetError, match="count"):
        stream.take(0, -2)
    with pytest.raises(DatasetError, match="position"):
        stream.epoch_of(-1)


def test_offline_switches_are_set(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import datasets

    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    load_rows(path, prompt_key="prompt")  # through datasets (a JSON file is read without it)
    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "1"
