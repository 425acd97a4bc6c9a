"""The trainer's rollout glue: groups drawn by a node's engine, scored, shipped as packed bytes and
rebuilt by ``batch_from_groups``, give exactly the tensors ``sample_groups`` gives locally; the
version gate holds a task until its node has the policy version the task names."""

from __future__ import annotations

import json
import random
import threading
import time
import types

import pytest
import torch

from elasticrl.config import ModelConfig
from elasticrl.policy.tiny import TinyCausalLM
from elasticrl.policy.vocab import CharVocab
from elasticrl.rl.rewards import reward_function
from elasticrl.rl.rollout import sample_groups
from elasticrl.rl.tasks import Example, make_task
from elasticrl.rollout.tiny_engine import TinyEngine
from elasticrl.scheduler.state import FetchedGroup, Split
from elasticrl.scheduler.worker import Assignment
from elasticrl.train.rollout_link import (
    EngineWorker,
    GateClosed,
    PolicyVersionTimeout,
    VersionGate,
    batch_from_groups,
    iteration_tasks,
)
from elasticrl.train.rollout_only import CoordinatorWeights


def engine(model, vocab, task, version: int = 7) -> EngineWorker:
    """The generate side only (no coordinator): what the worker thread calls."""
    w = EngineWorker.__new__(EngineWorker)
    lock = threading.RLock()
    w.engine = TinyEngine(model, vocab, lock=lock, policy_version=version)
    w.decode, w.reward, w.lock = vocab.decode, reward_function([], None, task), lock
    w.gate, w.stop_token_ids, w.version_timeout_s, w.groups_done = VersionGate(version), (), 5.0, 0
    w.error, w._failures, w._failures_lock, w._stop = None, 0, threading.Lock(), None
    return w


def test_shipped_groups_rebuild_the_locally_sampled_batch():
    torch.manual_seed(0)
    vocab, task = CharVocab(), make_task("reverse", 4)
    model = TinyCausalLM(ModelConfig(), len(vocab))
    examples = task.sample(random.Random(1), 3)
    specs = iteration_tasks(
        examples, lambda text: vocab.encode(text, bos=True), iteration=2, seed=5, group_size=4, max_new_tokens=5,
        temperature=1.0, policy_version=7,
    )
    assert [s.task_id for s in specs] == ["i2-p00000", "i2-p00001", "i2-p00002"]
    groups = engine(model, vocab, task)._generate_batch([Assignment(2, s, 10.0, False) for s in specs])
    assert [g.policy_version for g in groups] == [7, 7, 7]
    fetched = [
        FetchedGroup(2, s.task_id, "n0", g.policy_version, g.gen_seconds, 0.0, s.prompt_ids, Split.TRAIN, s.metadata_json, g.samples)
        for s, g in zip(specs, groups)
    ]
    batch = batch_from_groups(fetched, vocab.pad_id, torch.device("cpu"))
    # The same draw locally: one batch, the generator seeded by the first task.
    ref = sample_groups(
        model, vocab, task, [Example(json.loads(s.metadata_json)["prompt"], json.loads(s.metadata_json)["target"]) for s in specs],
        group_size=4,
        max_new_tokens=5, temperature=1.0, generator=torch.Generator().manual_seed(specs[0].sampling.seed),
    )
    assert torch.equal(batch.tokens, ref.tokens)
    assert torch.equal(batch.valid, ref.valid)
    assert torch.equal(batch.completion_mask, ref.completion_mask)
    assert torch.allclose(batch.old_logprobs * batch.completion_mask, ref.old_logprobs * ref.completion_mask)
    assert torch.equal(batch.rewards, ref.rewards)
    assert batch.completions == ref.completions
    assert [e.target for e in batch.examples] == [e.target for e in ref.examples]


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
    vocab, task = CharVocab(), make_task("copy", 3)
    examples = task.sample(random.Random(0), 2)
    train = iteration_tasks(examples, vocab.encode, iteration=3, seed=1, group_size=2, max_new_tokens=4,
                            temperature=1.0, policy_version=2, weights_version=(5 << 32) | 2)
    held_out = iteration_tasks(examples, vocab.encode, iteration=3, seed=1, group_size=2, max_new_tokens=4,
                               temperature=1.0, policy_version=2, split="eval")
    assert [t.task_id for t in held_out] == ["i3-e00000", "i3-e00001"] and {t.split for t in held_out} == {Split.EVAL}
    assert {t.sampling.seed for t in train}.isdisjoint({t.sampling.seed for t in held_out})
    assert json.loads(train[0].metadata_json)["weights_version"] == (5 << 32) | 2


def test_the_gate_holds_a_task_until_its_policy_version_is_pushed():
    torch.manual_seed(0)
    vocab, task = CharVocab(), make_task("reverse", 3)
    w = engine(TinyCausalLM(ModelConfig(), len(vocab)), vocab, task, version=3)
    (spec,) = iteration_tasks(task.sample(random.Random(2), 1), vocab.encode, iteration=5, seed=1, group_size=2,
                              max_new_tokens=4, temperature=1.0, policy_version=4)
    done = []
    thread = threading.Thread(target=lambda: done.append(w._generate_batch([Assignment(5, spec, 10.0, False)])))
    thread.start()
    time.sleep(0.3)
    assert not done, "drew a group of policy version 4 while the node still had version 3"
    w.engine.set_version(4)
    w.gate.advance(4)
    thread.join(timeout=10)
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
    """The coordinator's published weights as a list of versions (fetch_weights' seam)."""

    def __init__(self, versions):
        self.versions = list(versions)
        self.asked = []

    def fetch_weights(self, run_id, have_version, wait_s):
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
    (spec,) = iteration_tasks(task.sample(random.Random(2), 1), vocab.encode, iteration=1, seed=1, group_size=2,
                              max_new_tokens=4, temperature=1.0, policy_version=0)
    batch = [Assignment(1, spec, 10.0, False)]
    w = engine(TinyCausalLM(ModelConfig(), len(vocab)), vocab, task, version=0)
    from elasticrl.rl.rewards import RewardFunction

    w.reward = RewardFunction("broken", lambda prompt, completion, target: {}["answer"])  # KeyError inside
    with pytest.raises(RewardError):
        w._generate_batch(batch)
    assert isinstance(w.error, RewardError)  # check() raises it in the trainer: the node stops

    w = engine(TinyCausalLM(ModelConfig(), len(vocab)), vocab, task, version=0)
    w.engine.generate = lambda requests: (_ for _ in ()).throw(RuntimeError("CUDA error: out of memory"))
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
