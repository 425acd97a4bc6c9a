"""The policy update in micro-batches (``train.update``, ``trainer.micro_batch_rows``): the same
optimizer steps as one pass over a rank's rows (the loss is normalized globally, so micro-batch
losses and gradients add up), with the KL reference and the decoupled off-policy objective; a rank
with fewer rows than the others' micro-batches runs empty ones with a zero loss."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from elasticrl.config import load_config
from elasticrl.rl.rollout import RolloutBatch
from elasticrl.train.model import build_policy
from elasticrl.train.strategy import StrategyConfig, make_strategy
from elasticrl.train.update import micro_batch_bounds, update

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def config(micro_batch_rows: int, *, kl: float, staleness: int):
    return load_config(None, [("model.d_model", "16"), ("model.n_layers", "1"), ("model.n_heads", "2"),
                              ("model.max_seq_len", "16"), ("task.group_size", "3"), ("algorithm.kl_coef", str(kl)),
                              ("rollout.max_staleness", str(staleness)), ("trainer.updates_per_iteration", "2"),
                              ("trainer.micro_batch_rows", str(micro_batch_rows))])


def random_batch(rng: random.Random, rows: int, vocab: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    width = rng.randint(4, 12)
    tokens = torch.randint(0, vocab, (rows, width), generator=g)
    mask = (torch.rand(rows, width - 1, generator=g) < 0.6).float()
    mask[:, -1] = 1.0  # every row scores at least one token
    return RolloutBatch(tokens, torch.ones_like(tokens, dtype=torch.bool), mask, -torch.rand(rows, width - 1, generator=g) * 3,
                        torch.rand(rows, generator=g), [""] * rows, [None] * rows)


def trained(cfg, model, reference, batch) -> tuple[dict, dict]:
    parts = build_policy(cfg)
    strategy = make_strategy(StrategyConfig(name="ddp"))
    # SGD: a step linear in the gradients, so a wrong share of a micro-batch shows (Adam's
    # normalization would blur it into its noise).
    strategy.wrap(copy.deepcopy(model), lambda params: torch.optim.SGD(params, lr=0.5))
    tokens = float(batch.completion_mask.sum())
    sums = update(cfg, strategy, parts, reference, batch, num_tokens=tokens, num_samples=float(batch.tokens.shape[0]),
                  world=1, pad_id=parts.pad_id)
    return sums, {k: v.detach().clone() for k, v in strategy.unwrap().state_dict().items()}


@pytest.mark.parametrize("seed", range(6))
def test_micro_batches_take_the_same_steps_as_one_pass(seed, gloo_world_of_one):
    rng = random.Random(seed)
    kl, staleness = rng.choice([0.0, 0.05]), rng.choice([0, 1])
    whole_cfg = config(0, kl=kl, staleness=staleness)
    parts = build_policy(whole_cfg)
    reference = copy.deepcopy(parts.model).eval() if kl else None
    batch = random_batch(rng, 3 * rng.randint(1, 4), vocab=16)  # the character vocabulary has more
    want_sums, want = trained(whole_cfg, parts.model, reference, batch)
    for rows in (1, 2, 4):
        sums, got = trained(config(rows, kl=kl, staleness=staleness), parts.model, reference, batch)
        for name, w in want.items():
            assert torch.allclose(got[name], w, atol=1e-5, rtol=1e-4), (rows, name, (got[name] - w).abs().max())
        for key, w in want_sums.items():
            assert sums[key] == pytest.approx(w, rel=1e-4, abs=1e-6), (rows, key)


def test_a_rank_without_rows_runs_empty_micro_batches(gloo_world_of_one):
    cfg = config(2, kl=0.0, staleness=0)
    parts = build_policy(cfg)
    empty = RolloutBatch(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2, dtype=torch.bool), torch.zeros(0, 1),
                         torch.zeros(0, 1), torch.zeros(0), [], [])
    sums, state = trained(cfg, parts.model, None, empty)
    assert sums["loss"] == 0.0 and sums["tis_weight_mean"] == pytest.approx(2.0)  # 1.0 per step, as before
    assert all(torch.equal(state[k], v) for k, v in parts.model.state_dict().items())  # a zero gradient moves nothing


def test_micro_batch_bounds_cover_the_rows_evenly():
    assert micro_batch_bounds(7, 3) == [(0, 2), (2, 4), (4, 7)]
    assert micro_batch_bounds(2, 3) == [(0, 0), (0, 1), (1, 2)]
    assert micro_batch_bounds(0, 1) == [(0, 0)]
