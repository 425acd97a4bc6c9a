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


def run_world(world_size, make_rows, config, **kw):
    """leave_out on every rank (a thread each), with an all-gather between them."""
    barrier, shares, out, errors = threading.Barrier(world_size, timeout=10), {}, {}, {}

    def gather(rank):
        def all_gather(value):
            shares[rank] = value
            barrier.wait()
            return [shares[r] for r in range(world_size)]
        return all_gather

    def one(rank):
        r = out[rank] = make_rows()
        try:
            overlong.leave_out(config, r, first_tokens, LIMIT, rank=rank, world_size=world_size, gather=gather(rank), **kw)
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


def test_error_mode_names_the_first_row_and_the_longest_on_every_rank():
    out, errors = run_world(2, lambda: DatasetRows(rows([3, 12, 4, 30]), [], seed=0, per_iteration=2), cfg("error"))
    assert set(errors) == {0, 1} and all(isinstance(e, ConfigError) for e in errors.values())
    message = str(errors[1])
    assert message.startswith("task.overlong_prompts = error: task.path row 1 (0-based): its prompt renders to 13 tokens, "
                              "and the context holds 10 tokens (env.max_context_tokens, or the model's): no room")
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
    overlong.leave_out(cfg(env="guess"), made, counting, LIMIT, rank=0, world_size=1, gather=lambda v: [v])
    toy = SimpleNamespace(task=SimpleNamespace(kind="toy"), env=SimpleNamespace(name=""))
    overlong.leave_out(toy, object(), counting, LIMIT, rank=0, world_size=1, gather=lambda v: [v])
    made.checked = True
    overlong.leave_out(cfg(), made, counting, LIMIT, rank=0, world_size=1, gather=lambda v: [v])
    overlong.leave_out(cfg(), DatasetRows(rows([30, 1]), [], seed=0, per_iteration=1), counting, 0, rank=0, world_size=1,
                       gather=lambda v: [v])  # no context limit known
    assert calls == [] and len(made.train) == 1


def test_a_row_that_cannot_be_rendered_is_left_to_rollout():
    def picky(obs):
        if "bad" in obs:
            raise ValueError("cannot render")
        return first_tokens(obs)

    made = DatasetRows([{"prompt": "bad" * 10}, {"prompt": "x" * 20}, {"prompt": "ok"}], [], seed=0, per_iteration=1)
    overlong.leave_out(cfg(), made, picky, LIMIT, rank=0, world_size=1, gather=lambda v: [v])
    assert [r["prompt"] for r in made.train] == ["bad" * 10, "ok"]
