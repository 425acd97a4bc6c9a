"""The trainer's rollout glue: groups played by a node's engine (episodes of the single-turn prompt
env), shipped as packed bytes and rebuilt by ``batch_from_groups``, give tensors whose loss mask
covers exactly the policy's tokens and whose logprobs the trainer reproduces; the version gate
holds a task until its node has the policy version the task names."""

from __future__ import annotations

import functools
import json
import random
import threading
import time
import types

import pytest
import torch

from elasticrl.config import ModelConfig
from elasticrl.env import EnvSpec
from elasticrl.env.prompt import PromptEnv
from elasticrl.policy.codec import CharCodec
from elasticrl.policy.tiny import TinyCausalLM, token_logprobs
from elasticrl.policy.vocab import CharVocab
from elasticrl.rl.rewards import reward_function
from elasticrl.rl.tasks import Example, make_task
from elasticrl.rollout.episodes import EpisodeRunner, EpisodeSettings
from elasticrl.rollout.render import PlainRenderer
from elasticrl.rollout.tiny_engine import TinyEngine
from elasticrl.scheduler.state import FetchedGroup, SampleRecord, Split, TaskFailure
from elasticrl.scheduler.worker import Assignment
from elasticrl.train.rollout_link import (
    EngineWorker,
    GateClosed,
    PolicyVersionTimeout,
    VersionGate,
    batch_from_groups,
    iteration_tasks,
)
from elasticrl.repeats import Repeats
from elasticrl.train.rollout_only import CoordinatorWeights
from elasticrl.train.staleness import IdleMeter

pytestmark = pytest.mark.timeout(60)


def engine(model, vocab, task, version: int = 7, reward=None, make_env=None) -> EngineWorker:
    """The generate side only (no coordinator): what the worker thread calls."""
    w = EngineWorker.__new__(EngineWorker)
    lock = threading.RLock()
    reward = reward or reward_function([], None, task)
    make_env = make_env or EnvSpec("prompt", functools.partial(PromptEnv, score=reward.score)).make
    w.runner = EpisodeRunner(
        TinyEngine(model, vocab, lock=lock, policy_version=version), PlainRenderer(CharCodec(vocab).encode), make_env,
        EpisodeSettings(step_timeout_s=5.0), engine_lock=lock, decode=vocab.decode,
    )
    w.gate, w.stop_token_ids, w.version_timeout_s, w.groups_done, w.groups_failed = VersionGate(version), (), 5.0, 0, 0
    w.transcript_with_prompt = False
    w.error, w._failures, w._failures_lock, w._stop = None, 0, threading.Lock(), None
    w.idle, w._env_warnings = IdleMeter(), Repeats()
    return w


def rows_of(examples) -> list[dict]:
    return [{"prompt": e.prompt, "target": e.target} for e in examples]


def test_shipped_groups_rebuild_the_engines_episodes():
    torch.manual_seed(0)
    vocab, task = CharVocab(), make_task("reverse", 4)
    model = TinyCausalLM(ModelConfig(), len(vocab))
    examples = task.sample(random.Random(1), 3)
    specs = iteration_tasks(rows_of(examples), iteration=2, seed=5, group_size=4, max_new_tokens=5, temperature=1.0,
                            policy_version=7)
    assert [s.task_id for s in specs] == ["i2-p00000", "i2-p00001", "i2-p00002"]
    assert [s.prompt_text for s in specs] == [e.prompt for e in examples] and all(not s.prompt_ids for s in specs)
    w = engine(model, vocab, task)
    try:
        groups = w._generate_batch([Assignment(2, s, 10.0, False) for s in specs])
    finally:
        w.runner.close()
    assert [g.policy_version for g in groups] == [7, 7, 7] and all(len(g.samples) == 4 for g in groups)
    fetched = [
        FetchedGroup(2, s.task_id, "n0", g.policy_version, g.gen_seconds, 0.0, s.prompt_ids, Split.TRAIN, s.metadata_json, g.samples)
        for s, g in zip(specs, groups)
    ]
    batch = batch_from_groups(fetched, vocab.pad_id, torch.device("cpu"))
    row = 0
    for ex, g in zip(examples, groups):
        prompt = vocab.encode(ex.prompt, bos=True)
        for sample in g.samples:
            ids = sample.token_ids()
            assert ids[:len(prompt)] == prompt  # the env's observation (the prompt) opens the episode
            assert sample.mask_list() == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
            assert batch.tokens[row, :len(ids)].tolist() == ids and not batch.valid[row, len(ids):].any()
            # Column t scores token t + 1: only the completion's tokens are trained.
            expected = [0.0] * (len(prompt) - 1) + [1.0] * (len(ids) - len(prompt))
            assert batch.completion_mask[row, :len(ids) - 1].tolist() == expected
            assert batch.rewards[row] == pytest.approx(task.reward(ex, sample.text))
            assert batch.completions[row] == sample.text == vocab.decode(ids[len(prompt):])
            row += 1
    # The trainer's teacher-forced logprobs are the engine's, on every trained token.
    recomputed = token_logprobs(model, batch.tokens, batch.valid)
    mask = batch.completion_mask
    assert torch.allclose(recomputed * mask, batch.old_logprobs * mask, atol=1e-5)
    assert [e.target for e in batch.examples] == [e.target for e in examples for _ in range(4)]
    assert batch.episodes["episodes"] == 12 and batch.episodes["turns"] == 12 and batch.episodes["truncated"] == 0


def test_observation_tokens_are_masked_and_an_episode_without_prompt_starts_at_column_zero():
    meta = json.dumps({"row": {"instance": 3}})
    # An env episode: obs [5, 6], action [7, 8], obs [9], action [10].
    episode = SampleRecord.pack([5, 6, 7, 8, 9, 10], [0, 0, -0.5, -1.0, 0, -2.0], 1.0, loss_mask=[0, 0, 1, 1, 0, 1], turns=2,
                                env_s=0.25, truncated=True)
    plain = SampleRecord.pack([3, 4], [-0.25, -0.75], 0.0)
    batch = batch_from_groups([FetchedGroup(1, "a", "n0", 0, 0.0, 0.0, [], Split.TRAIN, meta, [episode, plain])], 0,
                              torch.device("cpu"))
    assert batch.tokens.tolist() == [[5, 6, 7, 8, 9, 10], [3, 4, 0, 0, 0, 0]]
    assert batch.completion_mask.tolist() == [[0, 1, 1, 0, 1], [1, 0, 0, 0, 0]]
    assert batch.old_logprobs.tolist() == [[0, -0.5, -1.0, 0, -2.0], [-0.75, 0, 0, 0, 0]]
    assert batch.episodes == {"episodes": 2.0, "turns": 3.0, "env_s": 0.25, "truncated": 1.0}


def test_prompts_of_different_widths_and_empty_completions_are_placed_exactly():
    from elasticrl.scheduler.state import SampleRecord

    meta = json.dumps({"prompt": "p", "target": "t"})
    samples_a = [SampleRecord.pack([7, 8, 9], [-0.5, -1.0, -1.5], 1.0, text="abc"), SampleRecord.pack([], [], 0.0)]
    samples_b = [SampleRecord.pack([4], [-0.25], 0.5, text="x")]
    groups = [
        FetchedGroup(1, "a", "n0", 3, 0.0, 0.0, [1, 2], Split.TRAIN, meta, samples_a),
        FetchedGroup(1, "b", "n0", 3, 0.0, 0.0, [1, 2, 3, 5], Split.TRAIN, meta, samples_b),
    ]
    pad = 0
    batch = batch_from_groups(groups, pad, torch.device("cpu"))
    # width 4 (the longest prompt), length 3 (the longest completion); prompts left-padded.
    assert batch.tokens.tolist() == [
        [0, 0, 1, 2, 7, 8, 9],
        [0, 0, 1, 2, 0, 0, 0],
        [1, 2, 3, 5, 4, 0, 0],
    ]
    assert batch.valid.tolist() == [
        [False, False, True, True, True, True, True],
        [False, False, True, True, False, False, False],
        [True, True, True, True, True, False, False],
    ]
    # Column t scores token t + 1: the completion of a row starts at column width - 1 = 3.
    assert batch.completion_mask.tolist() == [[0, 0, 0, 1, 1, 1], [0] * 6, [0, 0, 0, 1, 0, 0]]
    assert batch.old_logprobs.tolist() == [[0, 0, 0, -0.5, -1.0, -1.5], [0] * 6, [0, 0, 0, -0.25, 0, 0]]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5] and batch.completions == ["abc", "", "x"]


def test_an_empty_shard_is_an_empty_batch():
    batch = batch_from_groups([], CharVocab().pad_id, torch.device("cpu"))
    assert batch.tokens.shape[0] == 0 and batch.rewards.numel() == 0


def test_eval_tasks_have_their_own_ids_seeds_and_split():
    task = make_task("copy", 3)
    rows = rows_of(task.sample(random.Random(0), 2))
    train = iteration_tasks(rows, iteration=3, seed=1, group_size=2, max_new_tokens=4,
                            temperature=1.0, policy_version=2, weights_version=(5 << 32) | 2)
    held_out = iteration_tasks(rows, iteration=3, seed=1, group_size=2, max_new_tokens=4,
                               temperature=1.0, policy_version=2, split="eval")
    assert [t.task_id for t in held_out] == ["i3-e00000", "i3-e00001"] and {t.split for t in held_out} == {Split.EVAL}
    assert {t.sampling.seed for t in train}.isdisjoint({t.sampling.seed for t in held_out})
    assert json.loads(train[0].metadata_json)["weights_version"] == (5 << 32) | 2
    assert json.loads(train[1].metadata_json)["row"] == rows[1]


def test_a_row_too_large_for_a_task_is_refused_with_its_index():
    rows = [{"prompt": "a"}, {"prompt": "b" * (70 << 10)}]
    with pytest.raises(ValueError, match="row 1 of the train rows is .* bytes"):
        iteration_tasks(rows, iteration=1, seed=1, group_size=2, max_new_tokens=4, temperature=1.0, policy_version=0)


def test_the_gate_holds_a_task_until_its_policy_version_is_pushed():
    torch.manual_seed(0)
    vocab, task = CharVocab(), make_task("reverse", 3)
    w = engine(TinyCausalLM(ModelConfig(), len(vocab)), vocab, task, version=3)
    (spec,) = iteration_tasks(rows_of(task.sample(random.Random(2), 1)), iteration=5, seed=1, group_size=2,
                              max_new_tokens=4, temperature=1.0, policy_version=4)
    done = []
    thread = threading.Thread(target=lambda: done.append(w._generate_batch([Assignment(5, spec, 10.0, False)])))
    thread.start()
    time.sleep(0.3)
    assert not done, "drew a group of policy version 4 while the node still had version 3"
    w.runner.engine.set_version(4)
    w.gate.advance(4)
    thread.join(timeout=10)
    w.runner.close()
    assert done and done[0][0].policy_version == 4
    w.version_timeout_s = 0.2
    with pytest.raises(PolicyVersionTimeout, match="needs policy version 9; this node still has 4"):
        w.gate.wait(9, 0, 0.2)


def test_closing_the_gate_wakes_a_waiting_engine_thread_at_once():
    """A stopping worker must not leave engine threads parked for version_timeout_s (600 s): the
    interpreter would wait for them at exit, holding up torchrun's restart of the group."""
    gate = VersionGate(version=1)
    raised = []

    def wait():
        try:
            gate.wait(5, 0, 600)
        except GateClosed as exc:
            raised.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    gate.close()
    thread.join(timeout=5)
    assert raised and time.monotonic() - t0 < 5
    with pytest.raises(GateClosed):
        gate.wait(1, 0, 600)  # closed for good, even for a version it holds


class FakeWeightsClient:
    """Published weights as a list of versions (the seam of ``WeightFetcher.fetch``)."""

    def __init__(self, versions):
        self.versions = list(versions)
        self.asked = []

    def fetch(self, have_version, wait_s):
        self.asked.append(have_version)
        newer = [v for v in self.versions if v > have_version]
        if not newer:
            time.sleep(min(wait_s, 0.01))
            return None
        return newer[0], b""


class RecordingEngine:
    def __init__(self):
        self.loaded = []

    def update_weights(self, named_tensors, *, version):
        self.loaded.append(version)


def test_rollout_only_weights_must_reach_the_task_policy_version(monkeypatch):
    """After a re-formed group republished an older policy under a newer generation, a task of
    the earlier generation still waits for (at least) its own policy version."""
    monkeypatch.setattr("elasticrl.train.rollout_only.unpack_state_dict", lambda blob: {})
    old_task = (0 << 32) | 7  # generation 0, policy 7
    client = FakeWeightsClient([(0 << 32) | 6, (1 << 32) | 4, (1 << 32) | 5, (1 << 32) | 7])
    engine = RecordingEngine()
    gate = CoordinatorWeights(client, "r.rollout", engine, threading.RLock())
    gate.refresh(-1, 5)
    assert gate.weights_version == (0 << 32) | 6 and not gate.holds(old_task, 7)
    gate.wait(7, old_task, 5)
    assert engine.loaded == [6, 4, 5, 7]  # generation 1's policy 4 (newer version number) was not enough
    assert gate.holds(old_task, 7) and gate.holds(old_task, 6) and not gate.holds((2 << 32), 0)


def test_a_stopped_rollout_only_gate_stops_waiting():
    gate = CoordinatorWeights(FakeWeightsClient([]), "r.rollout", RecordingEngine(), threading.RLock())
    threading.Timer(0.1, gate.close).start()
    t0 = time.monotonic()
    with pytest.raises(GateClosed):
        gate.refresh(-1, 600)
    assert time.monotonic() - t0 < 5


def test_a_failing_reward_stops_the_worker_and_engine_failures_do_after_a_few():
    from elasticrl.errors import ElasticRLError
    from elasticrl.rl.rewards import RewardError
    from elasticrl.train.rollout_link import MAX_ENGINE_FAILURES

    torch.manual_seed(0)
    vocab, task = CharVocab(), make_task("reverse", 3)
    (spec,) = iteration_tasks(rows_of(task.sample(random.Random(2), 1)), iteration=1, seed=1, group_size=2,
                              max_new_tokens=4, temperature=1.0, policy_version=0)
    batch = [Assignment(1, spec, 10.0, False)]
    from elasticrl.rl.rewards import RewardFunction

    broken = RewardFunction("broken", lambda prompt, completion, target: {}["answer"])  # KeyError inside
    w = engine(TinyCausalLM(ModelConfig(), len(vocab)), vocab, task, version=0, reward=broken)
    with pytest.raises(RewardError):
        w._generate_batch(batch)
    assert isinstance(w.error, RewardError)  # check() raises it in the trainer: the node stops

    w = engine(TinyCausalLM(ModelConfig(), len(vocab)), vocab, task, version=0)
    w.runner.engine.generate = lambda requests: (_ for _ in ()).throw(RuntimeError("CUDA error: out of memory"))
    for attempt in range(1, MAX_ENGINE_FAILURES + 1):
        with pytest.raises(RuntimeError):
            w._generate_batch(batch)
        assert (w.error is None) == (attempt < MAX_ENGINE_FAILURES)  # transient until it keeps failing
    assert isinstance(w.error, ElasticRLError) and "failed 3 batches in a row" in str(w.error)

    # The gate failing (the run closed while a rollout-only worker waited for weights) is not the engine's.
    w = engine(TinyCausalLM(ModelConfig(), len(vocab)), vocab, task, version=0)
    w.gate = types.SimpleNamespace(wait=lambda *a: (_ for _ in ()).throw(ElasticRLError("run 'r.rollout' is closed")))
    for _ in range(MAX_ENGINE_FAILURES + 1):
        with pytest.raises(ElasticRLError, match="closed"):
            w._generate_batch(batch)
    assert w.error is None


def test_a_group_whose_env_fails_comes_back_as_a_failed_attempt_not_an_engine_failure(caplog):
    """An env error fails its group (retried elsewhere by the scheduler), never the engine worker;
    the log gets one line for the tasks that fail the same way, not one a task."""

    class Flaky:
        def reset(self, *, seed=None, options=None):
            return options["prompt"], {}

        def step(self, action):
            raise ConnectionError("the browser went away")

    torch.manual_seed(0)
    vocab, task = CharVocab(), make_task("reverse", 3)
    rows = rows_of(task.sample(random.Random(2), 2))
    specs = iteration_tasks(rows, iteration=1, seed=1, group_size=3, max_new_tokens=4, temperature=1.0, policy_version=0)
    w = engine(TinyCausalLM(ModelConfig(), len(vocab)), vocab, task, version=0, make_env=Flaky)
    try:
        for _ in range(4):  # more than MAX_ENGINE_FAILURES: env errors never count against the engine
            out = w._generate_batch([Assignment(1, s, 10.0, False) for s in specs])
            assert [type(o) for o in out] == [TaskFailure, TaskFailure]
            assert out[0].task_id == specs[0].task_id and "ConnectionError: the browser went away" in out[0].reason
            assert 1 <= out[0].env_errors <= 3
    finally:
        w.runner.close()
    assert w.error is None and w.groups_failed == 8
    lines = [r.getMessage() for r in caplog.records if "failed in its environment" in r.getMessage()]
    assert len(lines) == 1 and "more tasks failing the same way are counted and written once every 30s" in lines[0], lines


def test_a_group_is_stamped_with_the_version_the_engine_drew_it_with_not_the_tasks_minimum():
    """With rollout.max_staleness a task names the oldest version it accepts; the group records
    the engine's own (newer) version, which the trainer's lag and staleness bound are computed from."""
    torch.manual_seed(0)
    vocab, task = CharVocab(), make_task("reverse", 3)
    specs = iteration_tasks(rows_of(task.sample(random.Random(3), 2)), iteration=9, seed=1, group_size=2,
                            max_new_tokens=3, temperature=1.0, policy_version=5)
    w = engine(TinyCausalLM(ModelConfig(), len(vocab)), vocab, task, version=8)
    w.idle.take()
    try:
        groups = w._generate_batch([Assignment(9, s, 10.0, False) for s in specs])
    finally:
        w.runner.close()
    assert [g.policy_version for g in groups] == [8, 8]
    assert w.idle.take() < 1.0  # the engine had work in hand for part of the time


def test_an_episode_whose_weights_change_between_turns_records_the_oldest_version():
    torch.manual_seed(0)
    vocab, task = CharVocab(), make_task("reverse", 3)
    lock = threading.RLock()
    tiny = TinyEngine(TinyCausalLM(ModelConfig(), len(vocab)), vocab, lock=lock, policy_version=4)

    class TwoTurns:
        def reset(self, *, seed=None, options=None):
            return "12=", {}

        def step(self, action):
            with lock:
                first = tiny.policy_version == 4
                tiny.set_version(6)  # the trainer pushed a newer policy between the two turns
            return ("34=", 0.0, False, False, {}) if first else ("", 1.0, True, False, {})

    runner = EpisodeRunner(tiny, PlainRenderer(CharCodec(vocab).encode), TwoTurns, EpisodeSettings(max_turns=2, step_timeout_s=5.0),
                           engine_lock=lock, decode=vocab.decode)
    from elasticrl.rollout.engine import SamplingSpec
    from elasticrl.rollout.episodes import GroupTask

    try:
        (outcome,) = runner.play([GroupTask(task_id="t", row={}, episodes=1, seed=1, sampling=SamplingSpec(max_new_tokens=2))])
    finally:
        runner.close()
    (episode,) = outcome.episodes
    assert episode.turns == 2 and episode.policy_version == 4


def test_a_rollout_only_gate_catches_up_to_the_newest_version_when_its_tasks_accept_older(monkeypatch):
    """With rollout.max_staleness >= 1 a task's minimum version may be older than the newest
    published one: the worker still loads the newest (without waiting for it), so its lag stays small."""
    monkeypatch.setattr("elasticrl.train.rollout_only.unpack_state_dict", lambda blob: {})
    monkeypatch.setattr("elasticrl.train.rollout_only.CATCH_UP_EVERY_S", 0.0)
    client = FakeWeightsClient([1, 2])
    engine = RecordingEngine()
    gate = CoordinatorWeights(client, "r.rollout", engine, threading.RLock())
    gate.wait(1, 1, 5)
    assert engine.loaded == [1, 2] and gate.weights_version == 2
    assert client.asked[-1] == 1  # the catch-up asked for anything newer than what the task needed


@pytest.mark.parametrize("published, engine_dtype, warned", [
    (torch.bfloat16, "float32", True), (torch.bfloat16, "bfloat16", False), (torch.float32, "float32", False),
    (torch.bfloat16, "auto", False), (torch.float32, "", False),
])
def test_a_worker_says_once_when_the_published_weights_are_not_its_engines_dtype(monkeypatch, caplog, published, engine_dtype, warned):
    state = {"w": torch.ones(2, dtype=published), "steps": torch.arange(3)}
    monkeypatch.setattr("elasticrl.train.rollout_only.unpack_state_dict", lambda blob: state)
    gate = CoordinatorWeights(FakeWeightsClient([1, 2]), "r.rollout", RecordingEngine(), threading.RLock(), engine_dtype=engine_dtype)
    with caplog.at_level("WARNING", logger="elasticrl.train.rollout_only"):
        gate.refresh(-1, 5)
        gate.refresh(2, 5)
    said = [r.getMessage() for r in caplog.records if "engine.dtype" in r.getMessage()]
    assert len(said) == (1 if warned else 0), said
    if warned:
        assert f"weights are bfloat16 and this worker's engine.dtype is {engine_dtype}" in said[0]
