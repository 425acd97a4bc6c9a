"""Toy tasks: targets, partial-credit rewards, seeded prompts, the registry, the vocabulary."""

from __future__ import annotations

import random

import pytest

from elasticrl.policy.vocab import EOS, CharVocab
from elasticrl.rl.tasks import TASKS, make_task, positional_match


@pytest.mark.parametrize(
    "target,completion,expected",
    [
        ("1234", "1234", 1.0),
        ("1234", "1299", 0.5),
        ("1234", "", 0.0),
        ("1234", "12", 0.5),  # missing characters cost
        ("1234", "12345678", 0.5),  # and so do extra ones
        ("", "", 1.0),
    ],
)
def test_positional_match(target, completion, expected):
    assert positional_match(target, completion) == expected


def test_reverse_and_copy_targets():
    rng = random.Random(0)
    for ex in make_task("reverse", 5).sample(rng, 10):
        digits = ex.prompt.removesuffix("=")
        assert len(digits) == 5 and digits.isdigit() and ex.prompt.endswith("=")
        assert ex.target == digits[::-1]
    copy = make_task("copy", 3)
    ex = copy.sample(rng, 1)[0]
    assert ex.target == ex.prompt[:-1]
    assert copy.max_new_tokens == 4  # three digits and EOS
    assert copy.reward(ex, ex.target) == 1.0


def test_prompts_depend_only_on_the_seed():
    task = make_task("reverse", 4)
    assert task.sample(random.Random("7/3"), 8) == task.sample(random.Random("7/3"), 8)
    assert task.sample(random.Random("7/3"), 8) != task.sample(random.Random("7/4"), 8)


def test_unknown_task_lists_the_valid_ones():
    with pytest.raises(ValueError, match="choose one of " + ", ".join(sorted(TASKS))):
        make_task("sort", 4)


def test_vocab_round_trip_stops_at_eos():
    vocab = CharVocab()
    ids = vocab.encode("4071=", bos=True)
    assert ids[0] == vocab.bos_id and vocab.decode(ids) == "4071="
    assert vocab.decode([*vocab.encode("12"), EOS, *vocab.encode("99")]) == "12"
    with pytest.raises(ValueError, match="'!' is not in the vocabulary"):
        vocab.encode("1!")
