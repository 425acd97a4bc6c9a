"""The trainer's rollout glue: groups drawn by a node's engine, scored, shipped as packed bytes and
rebuilt by ``batch_from_groups``, give exactly the tensors ``sample_groups`` gives locally; the
version gate holds a task until its node has the policy version the task names."""

from __future__ import annotations

import json
import random
import threading
import time

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
from elasticrl.train.rollout_link import EngineWorker, PolicyVersionTimeout, VersionGate, batch_from_groups, iteration_tasks


def engine(model, vocab, task, version: int = 7) -> EngineWorker:
    """The generate side only (no coordinator): what the worker thread calls."""
    w = EngineWorker.__new__(EngineWorker)
    lock = threading.RLock()
    w.engine = TinyEngine(model, vocab, lock=lock, policy_version=version)
    w.decode, w.reward, w.lock = vocab.decode, reward_function([], None, task), lock
    w.gate, w.stop_token_ids, w.version_timeout_s, w.groups_done = VersionGate(version), (), 5.0, 0
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
