"""The environment contract: loading an env by name, module or file; checking what reset/step
return (sync and async); the turn limit; the single-turn prompt env and the guessing game."""

from __future__ import annotations

import asyncio

import pytest

from elasticrl.env import EnvError, EnvLoadError, env_names, load_env, register_env
from elasticrl.env.base import call_close, call_reset, call_step, env_label
from elasticrl.env.guess import GuessEnv
from elasticrl.env.prompt import PromptEnv
from elasticrl.env.wrappers import TurnLimit

pytestmark = pytest.mark.timeout(30)

USER_ENV = '''
class Counter:
    """Counts to `goal`; the action must be the next number."""

    def __init__(self, goal=3):
        self.goal = goal

    def reset(self, seed=None, options=None):
        self.n = 0
        return "0", {}

    def step(self, action):
        ok = action.strip() == str(self.n + 1)
        self.n += ok
        return str(self.n), float(ok), self.n >= self.goal, False, {}
'''


def run(coro):
    return asyncio.run(coro)


def test_registered_names_and_a_users_file_and_module(tmp_path, monkeypatch):
    assert {"guess", "web", "search"} <= set(env_names())
    assert load_env("guess").factory is GuessEnv
    (tmp_path / "my_env.py").write_text(USER_ENV)
    spec = load_env(f"{tmp_path}/my_env.py:Counter", {"goal": 2})
    env = spec.make()
    assert env.goal == 2 and type(env).__name__ == "Counter"
    # Messages name a user's file as the spec did, not the module name it is imported under.
    assert env_label(TurnLimit(env, 3)) == f"{tmp_path}/my_env.py:Counter" and env_label(GuessEnv()) == "elasticrl.env.guess:GuessEnv"
    monkeypatch.chdir(tmp_path)
    assert load_env("my_env.py:Counter").make().goal == 3  # relative to the current directory
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_env("my_env:Counter").factory.__name__ == "Counter"


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("nope", {}, "env 'nope' is not registered; choose one of guess, search, web"),
        ("no_such_module_xyz:Env", {}, "module 'no_such_module_xyz' is not importable"),
        ("missing.py:Env", {}, "file 'missing.py' does not exist"),
        ("{dir}/my_env.py:Nope", {}, "has no attribute 'Nope'; its public callables: Counter"),
        ("{dir}/my_env.py:Counter", {"goal": 2, "colour": "red"}, r"env.kwargs \{'goal': 2, 'colour': 'red'\} do not fit"),
        ("{dir}/my_env.py:NotAnEnv", {}, r"class NotAnEnv has no step\(\)"),
        ("", {}, "must be a non-empty string"),
    ],
)
def test_a_bad_env_spec_says_what_is_wrong(tmp_path, name, kwargs, message):
    (tmp_path / "my_env.py").write_text(USER_ENV + "\nclass NotAnEnv:\n    def reset(self): pass\n")
    with pytest.raises(EnvLoadError, match=message):
        load_env(name.format(dir=tmp_path), kwargs)


def test_register_refuses_to_shadow_unless_asked():
    with pytest.raises(ValueError, match="already registered"):
        register_env("guess", GuessEnv)
    register_env("guess-again", GuessEnv)
    assert load_env("guess-again").factory is GuessEnv


class Async:
    async def reset(self, *, seed=None, options=None):
        await asyncio.sleep(0)
        return [{"role": "user", "content": f"seed {seed}"}], {"k": 1}

    async def step(self, action):
        await asyncio.sleep(0)
        return "ok", 0.5, action == "done", False, None

    async def close(self):
        self.closed = True


def test_async_envs_and_chat_observations_are_accepted():
    env = Async()
    obs, info = run(call_reset(env, seed=4, options={}))
    assert obs == [{"role": "user", "content": "seed 4"}] and info == {"k": 1}
    assert run(call_step(env, "done")) == ("ok", 0.5, True, False, {})
    run(call_close(env))
    assert env.closed


def test_sync_envs_run_through_the_given_executor():
    used = []

    async def off_loop(fn):
        used.append(fn)
        return fn()

    env = load_env("guess").make()
    obs, _ = run(call_reset(env, seed=1, options={"secret": 4}, run_sync=off_loop))
    assert obs == "guess:" and len(used) == 1


class Bad:
    def __init__(self, result):
        self.result = result

    def reset(self, *, seed=None, options=None):
        return self.result

    def step(self, action):
        return self.result


@pytest.mark.parametrize(
    "result, method, message",
    [
        ("just text", "reset", r"reset\(\) returned str 'just text'; it must return \(observation, info\)"),
        ((b"bytes", {}), "reset", "the observation is a bytes"),
        (([{"role": "user"}], {}), "reset", "observation message 0 is .* needs a string 'role' and a string 'content'"),
        (("o", {}), "step", r"step\(\) returned tuple .* \(observation, reward, terminated, truncated, info\)"),
        (("o", float("nan"), False, False, {}), "step", "reward nan is not a finite number"),
        (("o", "1", False, False, {}), "step", "reward '1' is not a finite number"),
        (("o", 1.0, "yes", False, {}), "step", "terminated is 'yes'; it must be a bool"),
        (("o", 1.0, False, False, [1]), "step", "info is a list, expected a dict"),
    ],
)
def test_malformed_results_name_the_env_and_the_problem(result, method, message):
    env = Bad(result)
    call = call_reset(env, seed=0, options={}) if method == "reset" else call_step(env, "a")
    with pytest.raises(EnvError, match=message) as info:
        run(call)
    assert "test_env:Bad" in str(info.value)


def test_an_exception_inside_the_env_becomes_an_env_error_naming_it():
    class Boom:
        def reset(self, *, seed=None, options=None):
            raise KeyError("question")

    with pytest.raises(EnvError, match=r"test_env:.*Boom.reset\(\) raised KeyError: 'question'"):
        run(call_reset(Boom(), seed=0, options={}))


def test_turn_limit_truncates_after_max_turns_for_sync_and_async_envs():
    env = TurnLimit(GuessEnv(), 2)
    env.reset(options={"secret": 9})
    assert env.step("0")[2:4] == (False, False)
    assert env.step("1")[2:4] == (False, True)  # the second turn: truncated
    env.reset(options={"secret": 9})
    assert env.step("9")[2:4] == (True, False)  # a win is terminated, not truncated

    wrapped = TurnLimit(Async(), 1)
    assert run(call_step(wrapped, "x"))[2:4] == (False, True)
    with pytest.raises(ValueError, match="max_turns: 0"):
        TurnLimit(Async(), 0)


def test_the_prompt_env_is_one_scored_turn():
    seen = []

    def score(prompt, completion, row):
        seen.append((prompt, completion, row))
        return 0.75

    env = PromptEnv(score=score)
    assert env.reset(seed=3, options={"prompt": "2+2=", "answer": 4}) == ("2+2=", {})
    assert env.step("4") == ("", 0.75, True, False, {})
    assert seen == [("2+2=", "4", {"prompt": "2+2=", "answer": 4})]
    chat = PromptEnv(score=score, messages_key="messages")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi?"}]
    assert chat.reset(options={"messages": msgs})[0] == msgs
    chat.step("hello")
    assert seen[-1][0] == "hi?"  # a chat prompt reaches the reward as its last user message
    with pytest.raises(KeyError, match="no 'prompt' field"):
        PromptEnv(score=score).reset(options={"question": "q"})


def test_the_guessing_game():
    env = GuessEnv(low=0, high=9, turn_penalty=0.1)
    assert env.reset(options={"secret": 6})[0] == "guess:"
    assert env.step("3") == ("hi:", pytest.approx(-0.1), False, False,
                             {"valid_action": True, "guess": 3, "secret": 6, "consistent": True})
    assert env.step("x") == ("bad:", pytest.approx(-0.1), False, False, {"valid_action": False})
    assert env.step("a8b")[0] == "lo:"  # the first number in the action is the guess
    assert env.step("6")[1:3] == (pytest.approx(0.9), True)
    # A group shares its row: the same instance whatever the seed; no row: the seed decides.
    assert {GuessEnv().reset(seed=s, options={"instance": 13})[1]["secret"] for s in range(5)} == {3}
    assert len({GuessEnv().reset(seed=s, options={})[1]["secret"] for s in range(40)}) > 3
    shaped = GuessEnv(consistent_reward=0.25)
    shaped.reset(options={"secret": 6})
    assert [shaped.step(a)[1] for a in ("3", "2", "8", "9", "7", "6")] == [0.25, 0.0, 0.25, 0.0, 0.25, 1.0]
    with pytest.raises(ValueError, match=r"options\['secret'\]: 12 must be an int in \[0, 9\]"):
        GuessEnv().reset(options={"secret": 12})
    with pytest.raises(ValueError, match="low/high"):
        GuessEnv(low=5, high=5)
