"""The trainer's rollout glue: groups sampled by a node's engine, shipped as packed bytes and
rebuilt by ``batch_from_groups``, give exactly the tensors ``sample_groups`` gives locally."""

from __future__ import annotations

import json
import random
import threading

import torch

from elasticrl.config import PolicyConfig
from elasticrl.policy.tiny import TinyCausalLM
from elasticrl.policy.vocab import CharVocab
from elasticrl.rl.rollout import sample_groups
from elasticrl.rl.tasks import Example, make_task
from elasticrl.scheduler.state import FetchedGroup, Split
from elasticrl.scheduler.worker import Assignment
from elasticrl.train.rollout_link import NodeRolloutWorker, batch_from_groups, iteration_tasks


def engine(model, vocab, task) -> NodeRolloutWorker:
    """The generate side only (no coordinator): what the worker thread calls."""
    w = NodeRolloutWorker.__new__(NodeRolloutWorker)
    w.model, w.vocab, w.task, w.lock, w.policy_version = model, vocab, task, threading.Lock(), 7
    return w


def test_shipped_groups_rebuild_the_locally_sampled_batch():
    torch.manual_seed(0)
    vocab, task = CharVocab(), make_task("reverse", 4)
    model = TinyCausalLM(PolicyConfig(), len(vocab))
    examples = task.sample(random.Random(1), 3)
    specs = iteration_tasks(examples, vocab, iteration=2, seed=5, group_size=4, max_new_tokens=5, temperature=1.0)
    assert [s.task_id for s in specs] == ["i2-p00000", "i2-p00001", "i2-p00002"]
    groups = engine(model, vocab, task)._generate_batch([Assignment(2, s, 10.0, False) for s in specs])
    assert [g.policy_version for g in groups] == [7, 7, 7]
    fetched = [
        FetchedGroup(2, s.task_id, "n0", g.policy_version, g.gen_seconds, 0.0, s.prompt_ids, Split.TRAIN, s.metadata_json, g.samples)
        for s, g in zip(specs, groups)
    ]
    batch = batch_from_groups(fetched, vocab, torch.device("cpu"))
    # The same draw locally: one batch, the generator seeded by the first task.
    ref = sample_groups(
        model, vocab, task, [Example(**json.loads(s.metadata_json)) for s in specs], group_size=4,
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
    batch = batch_from_groups([], CharVocab(), torch.device("cpu"))
    assert batch.tokens.shape[0] == 0 and batch.rewards.numel() == 0
