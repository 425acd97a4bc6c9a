"""Prompts that leave no room to generate are found at start-up (``rl.overlong``): each rank
renders its share of the rows, every rank learns the whole list, and ``task.overlong_prompts``
drops those rows (the epochs shuffle over the rest) or stops the run naming the first."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from elasticrl.config import ConfigError
from elasticrl.rl import overlong
from elasticrl.rl.workload import DatasetRows

pytestmark = pytest.mark.timeout(30)

LIMIT = 10


def cfg(mode="drop", *, eval_fraction=0.0, eval_path="", messages_key="", env=""):
    return SimpleNamespace(task=SimpleNamespace(kind="dataset", prompt_key="prompt", messages_key=messages_key,
                                                eval_fraction=eval_fraction, eval_path=eval_path, overlong_prompts=mode),
                           env=SimpleNamespace(name=env))


def first_tokens(obs):
    """One token per character, plus BOS: a prompt of 9 characters fills a context of 10."""
    text = obs if isinstance(obs, str) else "".join(m["content"] for m in obs)
    return [0] * (len(text) + 1)


def rows(lengths):
    return [{"prompt": "x" * n, "id": i} for i, n in enumerate(lengths)]


def run_world(world_size, make_rows, config, limits=None):
    """leave_out on every rank (a thread each), with an all-gather between them; ``limits``: each
    rank's own context limit (LIMIT on every rank by default)."""
    barrier, shares, out, errors = threading.Barrier(world_size, timeout=10), {}, {}, {}
    limits = limits or [LIMIT] * world_size

    def gather(rank):
        def all_gather(value):
            shares[rank] = value
            barrier.wait()
            every = [shares[r] for r in range(world_size)]
            barrier.wait()  # nobody writes the next round's value before every rank read this one
            return every
        return all_gather

    def one(rank):
        r = out[rank] = make_rows()
        try:
            overlong.leave_out(config, r, first_tokens, limits[rank], rank=rank, world_size=world_size, gather=gather(rank))
        except Exception as exc:  # noqa: BLE001 - checked by the test
            errors[rank] = exc

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out, errors


def test_every_rank_drops_the_same_rows_and_rank_0_says_which(caplog):
    lengths = [3, 9, 4, 12, 5, 8, 30, 2]  # 9, 12, 30 characters: 10 tokens or more
    with caplog.at_level("WARNING", logger="elasticrl.rl.overlong"):
        out, errors = run_world(3, lambda: DatasetRows(rows(lengths), rows([1, 40]), seed=0, per_iteration=2), cfg())
    assert errors == {}
    for r in out.values():
        assert sorted(row["id"] for row in r.train) == [0, 2, 4, 5, 7] and r.checked
        assert [row["id"] for row in r.held_out] == [0]
        assert sorted(row["id"] for row in r.train_rows(1, 5)) == [0, 2, 4, 5, 7]  # one epoch: the kept rows once
    (warning,) = [rec.getMessage() for rec in caplog.records]  # rank 0's only
    assert "leaving out 3 of 8 training row(s) and 1 of 2 held-out row(s)" in warning and "(the longest 41 tokens)" in warning
    assert "task.path row 1 (0-based); task.path row 3 (0-based); task.path row 6 (0-based)" in warning


def test_ranks_that_know_other_limits_all_use_the_smallest_and_none_waits_alone():
    """The rows left out must not depend on which rank scanned which row (a resized world would
    drop others), and a rank that knows no limit must not skip the collective."""
    lengths = [3, 12, 15, 4, 18, 2, 9]
    for limits in ([10, 0], [0, 10], [10, 20], [20, 10, 0]):
        out, errors = run_world(len(limits), lambda: DatasetRows(rows(lengths), [], seed=0, per_iteration=1), cfg(), limits)
        assert errors == {}, limits
        assert all(sorted(row["id"] for row in r.train) == [0, 3, 5] for r in out.values()), limits
    out, errors = run_world(2, lambda: DatasetRows(rows(lengths), [], seed=0, per_iteration=1), cfg(), [0, 0])
    assert errors == {} and all(len(r.train) == 7 and not r.checked for r in out.values())


def test_error_mode_names_the_first_row_and_the_longest_on_every_rank():
    out, errors = run_world(2, lambda: DatasetRows(rows([3, 12, 4, 30]), [], seed=0, per_iteration=2), cfg("error"))
    assert set(errors) == {0, 1} and all(isinstance(e, ConfigError) for e in errors.values())
    message = str(errors[1])
    assert message.startswith("task.overlong_prompts = error: task.path row 1 (0-based): its prompt renders to 13 tokens, "
                              "and the context holds 10 tokens (the smaller of env.max_context_tokens and the model's): no room")
    assert "2 row(s) are so (the longest 31 tokens, task.path row 3 (0-based))" in message
    assert "task.overlong_prompts = drop" in message


def test_nothing_left_to_train_on_is_an_error_and_rows_that_fit_are_kept():
    _, errors = run_world(1, lambda: DatasetRows(rows([10, 11]), [], seed=0, per_iteration=1), cfg())
    assert "the prompt of every one of its 2 training rows renders to 10 tokens or more" in str(errors[0])
    out, errors = run_world(2, lambda: DatasetRows(rows([9 - 1, 0]), [], seed=0, per_iteration=1), cfg())
    assert errors == {} and len(out[0].train) == 2


def test_rows_are_named_by_their_prompt_after_an_eval_split_and_chat_messages_count():
    config = cfg(eval_fraction=0.5, messages_key="messages")
    train = [{"messages": [{"role": "user", "content": "long prompt here"}]}, {"messages": [{"role": "user", "content": "ok"}]}]
    _, errors = run_world(1, lambda: DatasetRows(train, [], seed=0, per_iteration=1), SimpleNamespace(
        task=SimpleNamespace(**{**vars(config.task), "overlong_prompts": "error"}), env=config.env))
    assert "the train row " in str(errors[0]) and "its prompt renders to 17 tokens," in str(errors[0])


def test_multi_turn_runs_toy_tasks_and_a_second_call_are_left_alone():
    calls = []

    def counting(obs):
        calls.append(obs)
        return first_tokens(obs)

    made = DatasetRows(rows([30]), [], seed=0, per_iteration=1)
    def no_gather(value):
        raise AssertionError("no collective for a run that checks nothing")

    overlong.leave_out(cfg(env="guess"), made, counting, LIMIT, rank=0, world_size=1, gather=no_gather)
    toy = SimpleNamespace(task=SimpleNamespace(kind="toy"), env=SimpleNamespace(name=""))
    overlong.leave_out(toy, object(), counting, LIMIT, rank=0, world_size=1, gather=no_gather)
    made.checked = True
    overlong.leave_out(cfg(), made, counting, LIMIT, rank=0, world_size=1, gather=no_gather)
    overlong.leave_out(cfg(), DatasetRows(rows([30, 1]), [], seed=0, per_iteration=1), counting, 0, rank=0, world_size=1,
                       gather=lambda v: [v])  # no context limit known
    assert calls == [] and len(made.train) == 1


def test_a_resume_from_a_checkpoint_of_another_row_count_says_so(caplog):
    made = DatasetRows(rows([1, 2, 30]), [], seed=0, per_iteration=1)
    overlong.leave_out(cfg(), made, first_tokens, LIMIT, rank=0, world_size=1, gather=lambda v: [v])
    with caplog.at_level("WARNING", logger="elasticrl.rl.workload"):
        made.resume(4, {"next_row": 4, "rows_per_epoch": 2})
        assert not [r for r in caplog.records if r.name == "elasticrl.rl.workload"]
        made.resume(4, {"next_row": 4, "rows_per_epoch": 3})
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "elasticrl.rl.workload"]
    assert "taken with 3 training rows per epoch and this run has 2" in warning and "may repeat or be skipped" in warning


def test_a_context_known_from_the_config_before_any_engine(tmp_path):
    from elasticrl.rl.workload import context_tokens

    tiny = SimpleNamespace(model=SimpleNamespace(kind="tiny", max_seq_len=64, path=""), env=SimpleNamespace(max_context_tokens=0))
    assert context_tokens(tiny) == 64
    tiny.env.max_context_tokens = 40
    assert context_tokens(tiny) == 40
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 32}')
    hf = SimpleNamespace(model=SimpleNamespace(kind="hf", max_seq_len=64, path=str(tmp_path)), env=SimpleNamespace(max_context_tokens=100))
    assert context_tokens(hf) == 32
    (tmp_path / "config.json").write_text('{}')
    hf.env.max_context_tokens = 0
    assert context_tokens(hf) == 0


def test_a_row_that_cannot_be_rendered_is_left_to_rollout():
    def picky(obs):
        if "bad" in obs:
            raise ValueError("cannot render")
        return first_tokens(obs)

    made = DatasetRows([{"prompt": "bad" * 10}, {"prompt": "x" * 20}, {"prompt": "ok"}], [], seed=0, per_iteration=1)
    overlong.leave_out(cfg(), made, picky, LIMIT, rank=0, world_size=1, gather=lambda v: [v])
    assert [r["prompt"] for r in made.train] == ["bad" * 10, "ok"]


def test_each_ranks_scan_runs_in_what_the_trainer_gives_it():
    """The trainer runs the scan on a thread while the ranks poll together (a big dataset takes
    minutes, past one collective's time limit): ``run`` gets the whole scan of this rank's share."""
    ran = []

    def run(scan):
        ran.append(True)
        return scan()

    made = DatasetRows(rows([3, 30]), [], seed=0, per_iteration=1)
    overlong.leave_out(cfg(), made, first_tokens, LIMIT, rank=0, world_size=1, gather=lambda v: [v], run=run)
    assert ran == [True] and [r["id"] for r in made.train] == [0]
