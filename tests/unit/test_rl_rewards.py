"""Reward functions: the built-ins, loading by name / module / file, weighted sums, and the errors
that name what is wrong (a broken reward must never score 0 silently)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

from elasticrl.errors import ElasticRLError
from elasticrl.rl.rewards import (
    REWARDS,
    RewardError,
    RewardFunction,
    combine_rewards,
    exact_match,
    format_reward,
    load_reward,
    positional,
    reward_names,
)


def test_the_registry_holds_the_built_ins_and_not_the_task_reward():
    assert reward_names() == ["exact_match", "format", "positional"]
    assert "task" not in REWARDS


@pytest.mark.parametrize(
    "completion,target,expected",
    [("4071", "4071", 1.0), (" 4071\n", "4071", 1.0), ("4070", "4071", 0.0), ("", "4071", 0.0), ("40 71", "4071", 0.0)],
)
def test_exact_match(completion, target, expected):
    assert exact_match("1704=", completion, target) == expected


def test_positional_gives_partial_credit_with_the_task_convention():
    assert positional("1234=", "4399", "4321") == 0.5
    assert positional("1234=", "43", "4321") == 0.5  # missing characters cost
    assert positional("1234=", "432100", "4321") == pytest.approx(4 / 6)  # and so do extra ones


@pytest.mark.parametrize(
    "completion,target,expected",
    [
        ("9999", "4321", 1.0),  # right shape, wrong answer
        ("432", "4321", 0.0),  # too short
        ("43210", "4321", 0.0),  # too long
        ("43a1", "4321", 0.0),  # not only digits
        ("432\u00b2", "4321", 0.0),  # a superscript two is a unicode "digit", not an ASCII one
        ("", "4321", 0.0),
        ("hello", "world!", 1.0),  # a non-digit target: non-empty, no surrounding whitespace
        (" hello", "world", 0.0),
        ("hello\n", "world", 0.0),
        ("", "world", 0.0),
    ],
)
def test_format_reward(completion, target, expected):
    assert format_reward("p", completion, target) == expected


def test_load_reward_by_registered_name():
    fn = load_reward("format")
    assert isinstance(fn, RewardFunction) and fn.name == "format"
    assert fn("12=", "21", "21") == 1.0


def test_an_unknown_name_lists_the_registered_ones_and_the_other_forms():
    expected = r"'accuracy' is not registered; choose one of exact_match, format, positional.*module:function"
    with pytest.raises(RewardError, match=expected) as info:
        load_reward("accuracy")
    assert isinstance(info.value, ValueError) and isinstance(info.value, ElasticRLError)


def test_load_reward_from_a_module_path():
    fn = load_reward("elasticrl.rl.rewards:exact_match")
    assert fn.name == "elasticrl.rl.rewards:exact_match" and fn.fn is exact_match
    assert fn("p", "ab", "ab") == 1.0


def _write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_load_reward_from_a_file_by_absolute_and_relative_path(tmp_path, monkeypatch):
    path = _write(
        tmp_path,
        "my_rewards.py",
        """
        from __future__ import annotations

        import dataclasses

        @dataclasses.dataclass
        class Bonus:  # a dataclass needs its module in sys.modules while it is built
            value: float = 0.25

        def length_bonus(prompt, completion, target):
            return Bonus().value * len(completion)
        """,
    )
    fn = load_reward(f"{path}:length_bonus")
    assert fn("p", "abcd", "x") == 1.0
    monkeypatch.chdir(tmp_path)
    assert load_reward("my_rewards.py:length_bonus")("p", "ab", "x") == 0.5
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert load_reward("../my_rewards.py:length_bonus")("p", "a", "x") == 0.25


def test_two_reward_files_with_the_same_name_do_not_collide(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _write(tmp_path / "a", "rewards.py", "def score(p, c, t):\n    return 1.0\n")
    b = _write(tmp_path / "b", "rewards.py", "def score(p, c, t):\n    return 2.0\n")
    fa, fb = load_reward(f"{a}:score"), load_reward(f"{b}:score")
    assert (fa("p", "c", "t"), fb("p", "c", "t")) == (1.0, 2.0)


def test_a_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(RewardError, match=r"file '.*nope\.py' does not exist"):
        load_reward(f"{missing}:score")


def test_a_file_that_fails_to_run_is_named_with_its_error(tmp_path):
    path = _write(tmp_path, "broken.py", "raise RuntimeError('needs a GPU')\n")
    with pytest.raises(RewardError, match=r"broken\.py failed with RuntimeError: needs a GPU"):
        load_reward(f"{path}:score")
    assert not any("broken" in name for name in sys.modules if name.startswith("_elasticrl_reward_"))


def test_a_module_that_cannot_be_imported_carries_the_import_error():
    expected = r"module 'no_such_pkg_xyz\.rewards' is not importable: No module named 'no_such_pkg_xyz'"
    with pytest.raises(RewardError, match=expected):
        load_reward("no_such_pkg_xyz.rewards:score")


def test_a_missing_attribute_is_named_with_the_callables_that_exist(tmp_path):
    path = _write(tmp_path, "r.py", "def correctness(p, c, t):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"has no attribute 'corectness'; its public callables: correctness"):
        load_reward(f"{path}:corectness")
    with pytest.raises(RewardError, match=r"'elasticrl\.rl\.rewards' has no attribute 'nothing_here'"):
        load_reward("elasticrl.rl.rewards:nothing_here")


def test_an_attribute_that_is_not_callable_is_refused(tmp_path):
    path = _write(tmp_path, "r.py", "THRESHOLD = 0.5\n")
    with pytest.raises(RewardError, match=r"'THRESHOLD' in '.*r\.py' is a float, not callable"):
        load_reward(f"{path}:THRESHOLD")


def test_a_function_with_the_wrong_arguments_is_refused_when_loaded(tmp_path):
    path = _write(tmp_path, "r.py", "def score(completion):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"'score' cannot be called as fn\(prompt, completion, target\)"):
        load_reward(f"{path}:score")


def test_a_function_of_several_columns_or_keyword_only_ones_is_loaded(tmp_path):
    # Found by a user's run: the load-time check bound only (prompt, completion) and (prompt,
    # completion, target), so a reward naming two columns, or one keyword-only, was refused.
    path = _write(
        tmp_path,
        "r.py",
        "def two(prompt, completion, answer, word):\n    return float(completion == answer + word)\n"
        "def kw(prompt, completion, *, answer, unit='kg'):\n    return float(completion == f'{answer}{unit}')\n",
    )
    two, kw = load_reward(f"{path}:two"), load_reward(f"{path}:kw")
    assert two.required == ("answer", "word") and kw.required == ("answer",)
    assert two.score("p", "ab", {"prompt": "p", "answer": "a", "word": "b", "extra": 1}) == 1.0
    assert kw.score("p", "4kg", {"prompt": "p", "answer": 4}) == 1.0
    with pytest.raises(RewardError, match="takes 'word' but the task's row has no such field"):
        two.score("p", "a", {"prompt": "p", "answer": "a"})
    bad = _write(tmp_path, "b.py", "def score(prompt, completion, answer, /, word):\n    return 0.0\n")
    with pytest.raises(RewardError, match=r"'score' cannot be called as fn\(prompt, completion, target\)"):
        load_reward(f"{bad}:score")  # a positional-only column cannot come from the row by name


def test_a_malformed_spec_is_refused():
    with pytest.raises(RewardError, match="both parts non-empty"):
        load_reward("elasticrl.rl.rewards:")
    with pytest.raises(RewardError, match="must be a non-empty string"):
        load_reward("")


def _reward_file(tmp_path):
    return _write(
        tmp_path,
        "bad.py",
        """
        def raises(prompt, completion, target):
            raise KeyError(completion)

        def returns_none(prompt, completion, target):
            return None

        def returns_nan(prompt, completion, target):
            return float("nan")

        def returns_text(prompt, completion, target):
            return "1.0"

        def returns_bool(prompt, completion, target):
            return completion == target
        """,
    )


def test_a_reward_that_raises_is_an_error_naming_the_function_and_the_prompt(tmp_path):
    fn = load_reward(f"{_reward_file(tmp_path)}:raises")
    with pytest.raises(RewardError, match=r"bad\.py:raises' raised KeyError: 'xyz' \(prompt '1234='\)") as info:
        fn("1234=", "xyz", "4321")
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(
    "name,what",
    [("returns_none", r"returned NoneType None, not a number"), ("returns_text", r"returned str '1.0', not a number"),
     ("returns_nan", r"returned nan, not a finite number")],
)
def test_a_reward_that_returns_a_non_number_is_an_error(tmp_path, name, what):
    fn = load_reward(f"{_reward_file(tmp_path)}:{name}")
    with pytest.raises(RewardError, match=rf"bad\.py:{name}' {what}.*prompt '98='"):
        fn("98=", "89", "89")


def test_a_long_prompt_is_cut_in_the_message(tmp_path):
    fn = load_reward(f"{_reward_file(tmp_path)}:returns_none")
    with pytest.raises(RewardError, match=r"\.\.\. \(5000 chars\)") as info:
        fn("7" * 5000, "c", "t")
    assert len(str(info.value)) < 400


def test_a_bool_is_a_number(tmp_path):
    fn = load_reward(f"{_reward_file(tmp_path)}:returns_bool")
    assert fn("p", "a", "a") == 1.0 and fn("p", "a", "b") == 0.0


def test_combine_rewards_is_the_weighted_sum():
    fn = combine_rewards(["exact_match", "format", "positional"], [1.0, 0.1, 0.5])
    # "4399" vs "4321": not exact (0), right format (1), half the positions (0.5).
    assert fn("1234=", "4399", "4321") == pytest.approx(0.1 + 0.25)
    assert fn("1234=", "4321", "4321") == pytest.approx(1.6)
    assert fn.name == "1*exact_match + 0.1*format + 0.5*positional"
    assert combine_rewards(["format"]).name == "format" and combine_rewards(["format"], [2]).name == "2*format"
    assert combine_rewards(["exact_match", "format"])("p", "12", "12") == 2.0  # weights default to 1


def test_combine_rewards_reports_the_failing_component(tmp_path):
    fn = combine_rewards(["format", f"{_reward_file(tmp_path)}:returns_nan"], [1.0, 2.0])
    with pytest.raises(RewardError, match=r"^reward '.*bad\.py:returns_nan' returned nan") as info:
        fn("12=", "21", "21")
    assert "format" not in str(info.value)


def test_combine_rewards_refuses_bad_arguments():
    with pytest.raises(RewardError, match=r"weights: 1 weights for 2 reward specs"):
        combine_rewards(["exact_match", "format"], [1.0])
    with pytest.raises(RewardError, match=r"specs: \[\] must be a non-empty list"):
        combine_rewards([])
    with pytest.raises(RewardError, match=r"specs: 'exact_match' must be a non-empty list"):
        combine_rewards("exact_match")
    with pytest.raises(RewardError, match=r"the weight of 'format' is inf"):
        combine_rewards(["exact_match", "format"], [1.0, math.inf])
    with pytest.raises(RewardError, match=r"'accuracy' is not registered"):
        combine_rewards(["exact_match", "accuracy"])


def test_rewards_module_does_not_import_torch():
    code = "import sys, elasticrl.rl.rewards; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
