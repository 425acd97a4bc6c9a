"""The episode runner with a scripted engine (no model): lock-step batching of every live episode,
the token/mask/logprob layout of a multi-turn episode, the turn and context limits, env failures
and deadlines failing only their group, engine failures propagating, cancellation, the cap on
episodes in flight, and chat templates rendered turn by turn."""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import pytest

from elasticrl.env import EnvSpec, load_env
from elasticrl.policy.codec import CharCodec
from elasticrl.rollout import episodes
from elasticrl.rollout.engine import Group, Sample, SamplingSpec, report_progress
from elasticrl.rollout.episodes import EpisodeRunner, EpisodeSettings, GroupTask
from elasticrl.rollout.render import ChatRenderer, PlainRenderer

pytestmark = pytest.mark.timeout(60)

CODEC = CharCodec()
EOS = CODEC.eos_ids[0]


def text_of(ids: list[int]) -> str:
    """Every character of a context, across EOS tokens (CharVocab.decode stops at the first)."""
    return "".join(CODEC.vocab.chars[i - 3] for i in ids if i >= 3)


class ScriptedEngine:
    """Answers ``policy(context text, sample index)`` + EOS, logprob -0.5 per token."""

    def __init__(self, policy, *, max_context: int | None = None, fail: Exception | None = None):
        self.policy = policy
        self.max_context = max_context
        self.fail = fail
        self.policy_version = 3
        self.rows_per_call: list[int] = []
        self.requests_per_call: list[int] = []
        self.lock = threading.Lock()

    def generate(self, requests):
        if self.fail is not None:
            raise self.fail
        with self.lock:
            self.rows_per_call.append(sum(r.sampling.n for r in requests))
            self.requests_per_call.append(len(requests))
        out = []
        for r in requests:
            assert self.max_context is None or len(r.prompt_ids) < self.max_context
            samples = []
            for i in range(r.sampling.n):
                ids = CODEC.encode(self.policy(text_of(r.prompt_ids), i), bos=False) + [EOS]
                ids = ids[: r.sampling.max_new_tokens]
                samples.append(Sample(completion_ids=ids, logprobs=[-0.5] * len(ids),
                                      finish_reason="stop" if ids[-1] == EOS else "length", text=CODEC.decode(ids)))
            out.append(Group(task_id=r.task_id, prompt_ids=r.prompt_ids, samples=samples, policy_version=3, gen_seconds=0.0))
        return out


def bisect(context: str, index: int = 0) -> str:
    """The guessing game played well: keep the interval the feedback allows, guess its middle."""
    low, high = 0, 9
    for guess, answer in re.findall(r"(\d)(hi|lo):", context):
        if answer == "hi":
            low = int(guess) + 1
        else:
            high = int(guess) - 1
    return str((low + high) // 2)


def runner(engine, make_env=None, **settings) -> EpisodeRunner:
    make_env = make_env or load_env("guess").make
    return EpisodeRunner(engine, PlainRenderer(CODEC.encode), make_env, EpisodeSettings(**{"max_turns": 5, **settings}),
                         decode=CODEC.decode)


def groups(n: int, episodes: int = 3, *, max_new_tokens: int = 3, row=None) -> list[GroupTask]:
    return [
        GroupTask(task_id=f"t{k}", row=row if row is not None else {"secret": k % 10}, episodes=episodes, seed=k,
                  sampling=SamplingSpec(max_new_tokens=max_new_tokens))
        for k in range(n)
    ]


def test_every_live_episode_is_batched_into_one_generate_per_turn():
    engine = ScriptedEngine(bisect)
    r = runner(engine, linger_s=5.0)  # lock step ends when all are parked; a loaded machine may take over 20 ms
    try:
        out = r.play(groups(10, episodes=3))
    finally:
        r.close()
    assert all(o.episodes is not None and len(o.episodes) == 3 for o in out)
    # Bisection finds any of 0..9 within 4 guesses; 30 episodes were played in lock step.
    assert len(engine.rows_per_call) == 4, engine.rows_per_call
    assert engine.rows_per_call[0] == 30
    # Identical contexts go as one request with n = k: every game opens with "guess:" (30 rows, one
    # request); later, the 3 episodes of a game share their context turn after turn.
    assert engine.requests_per_call[0] == 1
    assert all(n <= 10 for n in engine.requests_per_call[1:])
    assert all(e.reward == 1.0 and not e.truncated and e.finish_reason == "stop" for o in out for e in o.episodes)
    assert sorted({e.turns for o in out for e in o.episodes}) == [1, 2, 3, 4]


def test_a_multi_turn_episode_is_one_sequence_with_only_the_actions_trained():
    engine = ScriptedEngine(bisect)
    r = runner(engine)
    try:
        (out,) = r.play(groups(1, episodes=1, row={"secret": 7}))
    finally:
        r.close()
    (e,) = out.episodes
    # guess:4 -> hi:7 -> win; tokens: BOS g u e s s : | 4 EOS | h i : | 7 EOS
    bos = CODEC.vocab.bos_id
    assert e.token_ids == [bos, *CODEC.encode("guess:", bos=False), *CODEC.encode("4", bos=False), EOS,
                           *CODEC.encode("hi:", bos=False), *CODEC.encode("7", bos=False), EOS]
    assert e.loss_mask == [0] * 7 + [1, 1] + [0] * 3 + [1, 1]
    assert e.logprobs == [0.0] * 7 + [-0.5, -0.5] + [0.0] * 3 + [-0.5, -0.5]
    assert (e.turns, e.rewards, e.reward, e.truncated) == (2, [0.0, 1.0], 1.0, False)
    assert e.prompt == "guess:" and e.text == "4\nhi:\n7"


def counting_progress(tasks: list[GroupTask]) -> tuple[list[GroupTask], dict[str, int]]:
    """``tasks`` whose progress reports are counted, by task id."""
    counts = {t.task_id: 0 for t in tasks}
    return [dataclasses.replace(t, progress=lambda task_id=t.task_id: counts.__setitem__(task_id, counts[task_id] + 1))
            for t in tasks], counts


def test_each_turn_of_each_episode_reports_progress_on_its_task():
    """What renews a task's lease while its episodes advance (``Assignment.progress``)."""
    engine = ScriptedEngine(bisect)
    r = runner(engine)
    tasks, counts = counting_progress(groups(4, episodes=2))
    try:
        out = r.play(tasks)
    finally:
        r.close()
    assert counts == {o.task_id: sum(e.turns for e in o.episodes) for o in out} and all(counts.values())


class SteppingEngine(ScriptedEngine):
    """Reports progress ``steps`` times inside each ``generate``, as a decoding loop does."""

    steps = 6

    def generate(self, requests):
        for _ in range(self.steps):
            report_progress()
            time.sleep(0.01)
        return super().generate(requests)


def test_a_long_generate_reports_progress_on_the_tasks_it_draws_for_throttled(monkeypatch):
    """One turn longer than a task's lease (a long chain of thought) keeps it while the engine
    advances: the runner passes the engine's reports to the tasks of that call, at most every
    PROGRESS_EVERY_S."""
    for every, per_call in ((0.0, SteppingEngine.steps), (3600.0, 1)):
        monkeypatch.setattr(episodes, "PROGRESS_EVERY_S", every)
        r = runner(SteppingEngine(bisect))
        tasks, counts = counting_progress(groups(3, episodes=2))
        try:
            out = r.play(tasks)
        finally:
            r.close()
        for o in out:  # each turn's end, plus per_call for each generate call its episodes were in
            turns = sum(e.turns for e in o.episodes)
            in_calls, rest = divmod(counts[o.task_id] - turns, per_call)
            # Lock step puts an episode's turn in the call of its siblings' (a turn lingering past
            # linger_s on a slow machine goes in a call of its own).
            assert rest == 0 and max(e.turns for e in o.episodes) <= in_calls <= turns, (every, o.task_id, counts)


def test_the_turn_limit_and_the_context_limit_truncate_and_never_overflow():
    never_right = ScriptedEngine(lambda ctx, i: "0")
    r = runner(never_right, max_turns=3)
    try:
        (out,) = r.play(groups(1, episodes=2, row={"secret": 9}))
    finally:
        r.close()
    assert all(e.turns == 3 and e.truncated and e.finish_reason == "length" and e.reward == 0 for e in out.episodes)

    # 7 tokens of prompt, 2 per action, 3 per observation: 12 tokens leave no room for a third turn.
    tight = ScriptedEngine(lambda ctx, i: "0", max_context=13)
    r = runner(tight, max_turns=10)
    try:
        (out,) = r.play(groups(1, episodes=1, row={"secret": 9}))
    finally:
        r.close()
    (e,) = out.episodes
    assert e.truncated and len(e.token_ids) <= 13 and e.turns == 2

    # A per-episode budget (env.max_context_tokens) below the engine's works the same way.
    r = runner(ScriptedEngine(lambda ctx, i: "0"), max_turns=10, max_context=10)
    try:
        (out,) = r.play(groups(1, episodes=1, row={"secret": 9}))
    finally:
        r.close()
    assert out.episodes[0].truncated and len(out.episodes[0].token_ids) <= 10


class Flaky:
    """Raises on its ``fail_at``-th step overall (counting across episodes)."""

    steps = 0
    lock = threading.Lock()

    def __init__(self, fail_at: int = 0, sleep_s: float = 0.0):
        self.fail_at, self.sleep_s = fail_at, sleep_s

    def reset(self, *, seed=None, options=None):
        return "guess:", {}

    def step(self, action):
        with Flaky.lock:
            Flaky.steps += 1
            n = Flaky.steps
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if n == self.fail_at:
            raise ValueError("the page did not load")
        return "lo:", 0.25, False, False, {}


def test_an_env_that_raises_fails_its_group_only_and_is_replaced():
    Flaky.steps = 0
    made = []

    def make():
        made.append(Flaky(fail_at=3))
        return made[-1]

    r = runner(ScriptedEngine(lambda ctx, i: "1"), make_env=make, max_turns=2)
    try:
        out = r.play(groups(3, episodes=2))
        again = r.play(groups(2, episodes=2))
    finally:
        r.close()
    failed = [o for o in out if o.episodes is None]
    assert len(failed) == 1 and "Flaky.step() raised ValueError: the page did not load" in failed[0].error
    assert failed[0].env_errors >= 1 and not failed[0].cancelled
    assert all(len(o.episodes) == 2 and all(e.reward == 0.5 for e in o.episodes) for o in out if o.episodes)
    assert all(o.episodes for o in again)
    assert len(made) <= 6 + 1  # envs are reused across episodes; the failed one is replaced


def test_a_step_past_its_deadline_fails_the_group_and_the_runner_goes_on():
    Flaky.steps = 0
    r = runner(ScriptedEngine(lambda ctx, i: "1"), make_env=lambda: Flaky(sleep_s=1.0), max_turns=1, step_timeout_s=0.2)
    try:
        t0 = time.monotonic()
        (out,) = r.play(groups(1, episodes=2))
        elapsed = time.monotonic() - t0
        assert out.episodes is None and "did not return within env.step_timeout_s = 0.2s" in out.error
        assert elapsed < 0.9  # the group fails at the deadline, not when the step returns
    finally:
        r.close()


def test_an_engine_error_is_not_the_envs_and_propagates():
    r = runner(ScriptedEngine(bisect, fail=RuntimeError("CUDA error: out of memory")))
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            r.play(groups(2))
    finally:
        r.close()


def test_closing_the_runner_ends_a_play_in_progress_instead_of_leaving_its_thread_blocked():
    """torchrun stops a worker with SIGTERM mid-rollout: the runner is closed while an engine
    thread waits in ``play``. That call must end (the process exit joins such threads; a blocked
    one held the worker until torchrun's SIGKILL 30 s later)."""
    Flaky.steps = 0
    r = runner(ScriptedEngine(lambda ctx, i: "1"), make_env=lambda: Flaky(sleep_s=0.3), max_turns=50,
               step_timeout_s=30)
    outcome: list = []
    player = threading.Thread(target=lambda: outcome.append(_play_or_error(r)), daemon=True)
    player.start()
    deadline = time.monotonic() + 10
    while Flaky.steps < 1 and time.monotonic() < deadline:  # in the middle of its episodes
        time.sleep(0.01)
    assert Flaky.steps >= 1, "the episodes never started"
    t0 = time.monotonic()
    r.close(timeout_s=5)
    player.join(timeout=5)
    assert not player.is_alive(), "play() still blocked after close()"
    assert time.monotonic() - t0 < 5
    assert outcome and isinstance(outcome[0], BaseException), outcome


def _play_or_error(r: EpisodeRunner):
    try:
        return r.play(groups(2, episodes=2))
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        return exc


def test_a_cancelled_group_stops_at_its_next_turn():
    cancelled = threading.Event()
    cancelled.set()
    task = GroupTask(task_id="t", row={"secret": 3}, episodes=2, seed=0, sampling=SamplingSpec(max_new_tokens=3),
                     cancelled=cancelled)
    engine = ScriptedEngine(bisect)
    r = runner(engine)
    try:
        (out,) = r.play([task])
    finally:
        r.close()
    assert out.cancelled and out.episodes is None and engine.rows_per_call == []


def test_episodes_in_flight_caps_the_envs_in_use():
    live, peak = [0], [0]
    lock = threading.Lock()

    class Counting:
        def reset(self, *, seed=None, options=None):
            with lock:
                live[0] += 1
                peak[0] = max(peak[0], live[0])
            return "guess:", {}

        def step(self, action):
            time.sleep(0.01)
            with lock:
                live[0] -= 1
            return "", 1.0, True, False, {}

    engine = ScriptedEngine(lambda ctx, i: "1")
    r = runner(engine, make_env=Counting, episodes_in_flight=4)
    try:
        out = r.play(groups(5, episodes=3))
    finally:
        r.close()
    assert all(o.episodes for o in out) and peak[0] <= 4 and max(engine.rows_per_call) <= 4


def test_an_async_env_and_a_final_reward_over_the_transcript():
    class Echo:
        async def reset(self, *, seed=None, options=None):
            return "say:", {}

        async def step(self, action):
            return "again:", 0.5, False, False, {}

    seen = []

    def final(prompt, transcript, row):
        seen.append((prompt, transcript, row))
        return 2.0

    r = EpisodeRunner(ScriptedEngine(lambda ctx, i: "ab"), PlainRenderer(CODEC.encode), Echo, EpisodeSettings(max_turns=2),
                      decode=CODEC.decode, final_reward=final)
    try:
        (out,) = r.play(groups(1, episodes=1, row={"id": 1}))
    finally:
        r.close()
    (e,) = out.episodes
    assert e.rewards == [0.5, 0.5, 2.0] and e.reward == 3.0 and e.truncated
    assert seen == [("say:", "ab\nagain:\nab", {"id": 1})]


# -- chat templates ---------------------------------------------------------------------------------


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from elasticrl.rollout.tiny_llama import write_tiny_llama

    from elasticrl.rollout.tiny_llama import CHARS

    path = write_tiny_llama(tmp_path_factory.mktemp("m") / "chat", vocab_size=96, chat_template=CHATML,
                            extra_tokens=("<|im_start|>", "<|im_end|>"), chars=CHARS + "\n")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_chat_observations_are_rendered_as_the_templates_delta(chat_tokenizer):
    tok = chat_tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    r = ChatRenderer(tok, [end])
    first = r.first([{"role": "system", "content": "play"}, {"role": "user", "content": "guess:"}])
    action = tok.encode("4", add_special_tokens=False) + [end]  # what the engine draws, stop token included
    second = r.next("hi:")
    full = tok.apply_chat_template(
        [{"role": "system", "content": "play"}, {"role": "user", "content": "guess:"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "hi:"}], add_generation_prompt=True, tokenize=True,
    )
    if not isinstance(full, list):
        full = full["input_ids"]
    # Turn by turn, the tokens are exactly what the template gives the whole conversation.
    assert first + action + second == full
    assert tok.decode(second) == "\n<|im_start|>user\nhi:<|im_end|>\n<|im_start|>assistant\n"
    assert r.close_action(stopped=False) == [end] and r.close_action(stopped=True) == []


def test_a_tokenizer_without_a_template_is_refused_with_the_fix(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from elasticrl.rollout.tiny_llama import write_tiny_llama

    tok = AutoTokenizer.from_pretrained(write_tiny_llama(tmp_path / "m"), local_files_only=True)
    with pytest.raises(ValueError, match="has no chat template"):
        ChatRenderer(tok, [2])


def test_plain_rendering_refuses_chat_messages_with_the_fix():
    r = runner(ScriptedEngine(bisect), make_env=lambda: type("Chatty", (), {
        "reset": lambda self, seed=None, options=None: ([{"role": "user", "content": "hi"}], {}),
        "step": lambda self, action: ("", 0.0, True, False, {}),
    })())
    try:
        (out,) = r.play(groups(1, episodes=1))
    finally:
        r.close()
    assert out.episodes is None and "set task.chat_template = true" in out.error


def test_an_observation_the_vocabulary_cannot_encode_fails_the_episode_with_the_character():
    spec = EnvSpec("x", lambda: type("Upper", (), {
        "reset": lambda self, seed=None, options=None: ("Guess!", {}),
        "step": lambda self, action: ("", 0.0, True, False, {}),
    })())
    r = runner(ScriptedEngine(bisect), make_env=spec.make)
    try:
        (out,) = r.play(groups(1, episodes=1))
    finally:
        r.close()
    assert out.episodes is None and "cannot be tokenized" in out.error and "'G'" in out.error


class StopsAtEquals:
    """Search-R1's shape: the env reads an action up to its closing tag (here "="); what the policy
    writes after it must be neither shown to the env nor trained on."""

    stop_strings = ("=",)

    def __init__(self):
        self.actions: list[str] = []

    def reset(self, *, seed=None, options=None):
        return "go:", {}

    def step(self, action):
        self.actions.append(action)
        return "", 1.0, True, False, {}


def test_an_envs_stop_string_ends_the_action_there():
    envs: list[StopsAtEquals] = []

    def make():
        envs.append(StopsAtEquals())
        return envs[-1]

    r = runner(ScriptedEngine(lambda ctx, i: "12=34"), make_env=make)
    try:
        (out,) = r.play(groups(1, episodes=1, max_new_tokens=8))
    finally:
        r.close()
    (e,) = out.episodes
    assert envs[0].actions == ["12="] and e.finish_reason == "stop"
    trained = [t for t, m in zip(e.token_ids, e.loss_mask) if m]
    assert text_of(trained) == "12=" and e.logprobs.count(-0.5) == 3  # "34" and EOS were cut


def test_stop_strings_are_checked_and_found_by_the_first_token_that_completes_one():
    from elasticrl.env.base import EnvError, cut_at_stop, stop_strings

    decode = "".join
    assert cut_at_stop(list("ab</sea"), ("</search>",), decode) == 7  # not there (yet): all kept
    assert cut_at_stop(["<search>q", "</sea", "rch>", " more", "</search>"], ("</search>",), decode) == 3
    assert cut_at_stop(list("x</answer>y</search>"), ("</search>", "</answer>"), decode) == 10

    class Bad:
        stop_strings = ["", "</x>"]

    with pytest.raises(EnvError, match=r"stop_strings = \['', '</x>'\] must be a str or a sequence of non-empty str"):
        stop_strings(Bad())
    assert stop_strings(StopsAtEquals()) == ("=",) and stop_strings(object()) == ()


def test_an_action_cut_at_a_stop_string_is_closed_as_the_template_closes_a_turn():
    # Found in review: a cut action was taken as stopped by the engine's end-of-turn token, which the
    # cut had removed, so a chat transcript went on without closing the assistant's turn.
    class Closing(PlainRenderer):
        def close_action(self, stopped):
            return [] if stopped else [EOS]

    r = EpisodeRunner(ScriptedEngine(lambda ctx, i: "12=34"), Closing(CODEC.encode), StopsAtEquals,
                      EpisodeSettings(max_turns=5), decode=CODEC.decode)
    try:
        (out,) = r.play(groups(1, episodes=1, max_new_tokens=8))
    finally:
        r.close()
    (e,) = out.episodes
    assert e.token_ids[-1] == EOS and e.loss_mask[-1] == 0 and text_of(e.token_ids[-4:-1]) == "12="
