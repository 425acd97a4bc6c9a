"""Seeded random differential and property tests of the RL math and of how fetched groups become
training tensors.

* Advantages (``elasticrl.rl.advantages``) against plain-Python references written from the
  docstrings and ``AlgorithmConfig.advantage``'s docs, over random group sizes (1 included),
  ties, flat groups, and their invariances (group order, order within a group, affine rewards).
* ``policy_loss`` (``elasticrl.rl.loss``) against a per-token loop of the documented objective,
  value, gradient and statistics, for every loss kind and aggregation, with and without the KL
  penalty, the reference logprobs and the decoupled (proximal) objective; and the invariances it
  must have: row order, padding amount and side, whatever values padding holds, splitting the
  batch across ranks with global counts (the trainer has no micro-batching: the rank split is its
  only accumulation, ``loss * world`` averaged by DDP).
* ``batch_from_groups`` (``elasticrl.train.rollout_link``): single- and multi-turn episodes,
  prompts or none, empty completions; each counted column scores exactly the policy token that
  follows it, observation tokens never count, and the loss of a shard, with a context-dependent
  "model" or the real tiny transformer, is the loss of its unpadded episodes whatever the shard.

The bugs it found are pinned by the ``test_bug_*`` tests at the end (each failed before its fix).

``ELASTICRL_RANDOM_SEEDS`` (default 10) sets the number of seeds.
"""

from __future__ import annotations

import json
import math
import os
import random
import zlib

import pytest
import torch

from elasticrl.config import ModelConfig
from elasticrl.policy.tiny import TinyCausalLM, token_logprobs
from elasticrl.rl.advantages import (
    ADVANTAGES,
    compute_advantages,
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
    rloo_advantages,
)
from elasticrl.rl.loss import AGGREGATIONS, LOSS_KINDS, policy_loss
from elasticrl.scheduler.state import FetchedGroup, SampleRecord, Split
from elasticrl.train.rollout_link import batch_from_groups

pytestmark = pytest.mark.timeout(120)

SEEDS = range(int(os.environ.get("ELASTICRL_RANDOM_SEEDS", "10")))
GRPO_EPS = 1e-6  # group_advantages' default eps
CPU = torch.device("cpu")


# ================================================================================================
# Advantages
# ================================================================================================


def ref_advantages(name: str, rewards: list[float], group_size: int) -> list[float]:
    """The documented estimators, group by group, in float64 Python."""
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        grp = rewards[start:start + group_size]
        s = len(grp)
        mean = math.fsum(grp) / s
        if name == "grpo":
            # "(r - mean) / (std + eps)", population std; "A group whose samples all scored the
            # same gets zero advantage ... never NaN"; a group of one is only centred (-> 0).
            if all(r == grp[0] for r in grp):
                out += [0.0] * s
                continue
            std = math.sqrt(math.fsum((r - mean) ** 2 for r in grp) / s)
            out += [(r - mean) / (std + GRPO_EPS) for r in grp]
        elif name == "dr_grpo":
            out += [r - mean for r in grp]
        elif name == "rloo":
            if s == 1:
                out.append(0.0)  # "A group of one has no other sample to compare with: its advantage is 0"
                continue
            total = math.fsum(grp)
            out += [r - (total - r) / (s - 1) for r in grp]
        else:
            raise AssertionError(name)
    return out


def _f32(values: list[float]) -> list[float]:
    return torch.tensor(values, dtype=torch.float32).tolist()


def random_rewards(rng: random.Random, num_groups: int, group_size: int) -> list[float]:
    """Rewards as float32 numbers, group after group: binary, flat, ties, partial credit, continuous."""
    out: list[float] = []
    for _ in range(num_groups):
        style = rng.choice(["binary", "flat", "ties", "fraction", "continuous", "scaled"])
        if style == "binary":
            grp = [float(rng.random() < 0.5) for _ in range(group_size)]
        elif style == "flat":
            grp = [rng.choice([0.0, 1.0, 0.5, -0.25, 3.0, 0.75, 12.0])] * group_size
        elif style == "ties":
            # Two values at least 0.05 apart: a closer pair is a spread float32 cannot resolve
            # against the mean (GRPO divides by that spread), which is precision, not a bug.
            a = rng.uniform(-2, 2)
            b = a + rng.choice([-1, 1]) * rng.uniform(0.05, 2)
            grp = [a if rng.random() < 0.7 else b for _ in range(group_size)]
        elif style == "fraction":  # positional partial credit k/n
            n = rng.choice([3, 4, 7, 10])
            grp = [rng.randint(0, n) / n for _ in range(group_size)]
        elif style == "continuous":
            grp = [round(rng.uniform(-5, 5), 2) for _ in range(group_size)]  # spreads float32 resolves
        else:
            scale = rng.choice([0.01, 100.0])
            grp = [scale * rng.randint(-3, 3) for _ in range(group_size)]
        grp = _f32(grp)
        if group_size > 1 and all(r == grp[0] for r in grp) and rng.random() < 0.5:
            # Half the flat groups hold a non-dyadic value (0.7, 2/3), whose float32 mean is
            # rounded: test_bug_grpo_flat_group_of_a_non_dyadic_reward_gets_nonzero_advantage.
            grp = [rng.choice([0.7, 2 / 3, 0.1])] * group_size
        out += grp
    return out


def _adv_tol(name: str, rewards: list[float]) -> float:
    big = max([1.0] + [abs(r) for r in rewards])
    return 2e-4 if name == "grpo" else 2e-6 * big


@pytest.mark.parametrize("seed", SEEDS)
def test_advantages_match_the_documented_estimators(seed):
    rng = random.Random(seed)
    for _ in range(12):
        group_size = rng.choice([1, 1, 2, 3, 4, 5, 8, 16])
        num_groups = rng.randint(1, 6)
        rewards = random_rewards(rng, num_groups, group_size)
        t = torch.tensor(rewards)
        for name in ADVANTAGES:
            got = compute_advantages(name, t, group_size)
            assert got.shape == t.shape and got.dtype == torch.float32
            assert torch.isfinite(got).all(), (name, rewards)
            expected = torch.tensor(ref_advantages(name, rewards, group_size), dtype=torch.float64)
            torch.testing.assert_close(got.double(), expected, atol=_adv_tol(name, rewards), rtol=1e-4,
                                       msg=f"{name} S={group_size} {rewards}")
            assert torch.equal(got, ADVANTAGES[name](t, group_size))
        # The named wrappers are what they say.
        assert torch.equal(grpo_advantages(t, group_size), group_advantages(t, group_size, scale=True))
        assert torch.equal(dr_grpo_advantages(t, group_size), group_advantages(t, group_size, scale=False))
        assert torch.equal(rloo_advantages(t, group_size), compute_advantages("rloo", t, group_size))


@pytest.mark.parametrize("seed", SEEDS)
def test_advantage_invariances(seed):
    rng = random.Random(1000 + seed)
    for _ in range(8):
        group_size = rng.choice([1, 2, 3, 4, 6, 8])
        num_groups = rng.randint(1, 5)
        rewards = random_rewards(rng, num_groups, group_size)
        t = torch.tensor(rewards)
        for name in ADVANTAGES:
            adv = compute_advantages(name, t, group_size)
            grid = adv.view(num_groups, group_size)
            tol = _adv_tol(name, rewards)
            # Group size 1: no other sample, no signal.
            if group_size == 1:
                assert (adv == 0).all(), name
            # Every estimator is centred within each group (GRPO, Dr. GRPO: r - mean; RLOO: S/(S-1) of it).
            torch.testing.assert_close(grid.sum(dim=1), torch.zeros(num_groups), atol=tol * group_size, rtol=0)
            # Permuting the groups permutes their advantages (each group on its own).
            perm = list(range(num_groups))
            rng.shuffle(perm)
            permuted = t.view(num_groups, group_size)[perm].reshape(-1)
            torch.testing.assert_close(compute_advantages(name, permuted, group_size).view(num_groups, group_size),
                                       grid[perm], atol=1e-6, rtol=0)
            # Permuting the samples of a group permutes its advantages.
            inner = list(range(group_size))
            rng.shuffle(inner)
            shuffled = t.view(num_groups, group_size)[:, inner].reshape(-1)
            torch.testing.assert_close(compute_advantages(name, shuffled, group_size).view(num_groups, group_size),
                                       grid[:, inner], atol=tol, rtol=1e-4)
            # Changing one group's rewards (even to NaN) leaves every other group's advantages alone.
            if num_groups > 1:
                g = rng.randrange(num_groups)
                other = t.clone().view(num_groups, group_size)
                other[g] = torch.tensor([float("nan")] + [rng.uniform(-3, 3) for _ in range(group_size - 1)])
                again = compute_advantages(name, other.reshape(-1), group_size).view(num_groups, group_size)
                keep = [i for i in range(num_groups) if i != g]
                assert torch.equal(again[keep], grid[keep]), name
        dr = compute_advantages("dr_grpo", t, group_size)
        # RLOO = S / (S - 1) * (r - mean).
        if group_size > 1:
            torch.testing.assert_close(compute_advantages("rloo", t, group_size), dr * group_size / (group_size - 1),
                                       atol=_adv_tol("rloo", rewards) * 2, rtol=1e-5)
        # Shift: r + c changes nothing (up to float32 rounding of the shifted rewards); scale a > 0:
        # GRPO unchanged (while std >> eps), Dr. GRPO and RLOO scale by a.
        a, c = rng.choice([0.5, 2.0, 4.0]), rng.choice([-1.0, 0.5, 3.0])
        moved = t * a + c  # a and c dyadic: exact for these magnitudes
        torch.testing.assert_close(compute_advantages("dr_grpo", moved, group_size), dr * a,
                                   atol=_adv_tol("dr_grpo", moved.tolist()) * 4, rtol=1e-5)
        grid = t.view(num_groups, group_size).double()
        spread = grid.std(dim=1, unbiased=False) if group_size > 1 else torch.zeros(num_groups, dtype=torch.float64)
        wide = (spread > 1e-2).repeat_interleave(group_size)
        g0, g1 = compute_advantages("grpo", t, group_size), compute_advantages("grpo", moved, group_size)
        torch.testing.assert_close(g1[wide], g0[wide], atol=1e-3, rtol=1e-3)
        # GRPO: unit population std in every group whose spread dwarfs eps.
        if group_size > 1:
            grid_adv = g0.view(num_groups, group_size)
            for i in range(num_groups):
                if spread[i] > 1e-2:
                    assert grid_adv[i].double().std(unbiased=False).item() == pytest.approx(1.0, abs=1e-3)


def test_integer_and_double_rewards_give_float_advantages():
    rewards = torch.tensor([0, 1, 1, 1, 0, 0])
    for name in ADVANTAGES:
        got = compute_advantages(name, rewards, 3)
        assert got.dtype == torch.float32
        assert torch.equal(got, compute_advantages(name, rewards.double(), 3))
        assert torch.allclose(got.double(), torch.tensor(ref_advantages(name, [0, 1, 1, 1, 0, 0], 3), dtype=torch.float64),
                              atol=1e-5)


# ================================================================================================
# policy_loss
# ================================================================================================

Entry = tuple  # (lp, old, ref, prox) of one counted token


def ref_policy_loss(rows: list[list[Entry]], advs: list[float], *, kind: str, clip_eps: float, kl_coef: float,
                    has_ref: bool, has_prox: bool, tis_cap: float, aggregation: str, num_tokens: float,
                    num_sequences: float):
    """The documented objective, token by token. ``rows[i]``: sample i's counted tokens in order.

    Returns (loss, d loss / d lp per counted token as rows, stats over the counted tokens or None).
    """
    total = 0.0
    grads: list[list[float]] = []
    n = clipped = capped = 0
    ratio_sum = k3_sum = w_sum = 0.0
    for entries, a in zip(rows, advs):
        scale = 1.0 / num_tokens if aggregation == "token" else 1.0 / (max(len(entries), 1) * num_sequences)
        row_grads = []
        for lp, old, ref, prox in entries:
            n += 1
            if has_prox:
                behaviour = math.exp(prox - old)  # pi_prox / pi_behaviour
                w, anchor = min(behaviour, tis_cap), prox
                capped += behaviour > tis_cap
            else:
                w, anchor = 1.0, old
            if kind == "reinforce":  # -logprob * A, never clipped
                loss, grad, ratio = -lp * a, -a, 1.0
            else:  # -min(ratio * A, clip(ratio, 1 +- eps) * A)
                ratio = math.exp(lp - anchor)
                unclipped = ratio * a
                bounded = min(max(ratio, 1.0 - clip_eps), 1.0 + clip_eps) * a
                loss = -min(unclipped, bounded)
                grad = 0.0 if bounded < unclipped else -a * ratio
                clipped += bounded < unclipped
            loss, grad = loss * w, grad * w
            if has_ref:
                d = ref - lp
                k3 = math.exp(d) - d - 1.0
                k3_sum += k3
                if kl_coef > 0:
                    loss += kl_coef * k3
                    grad += kl_coef * (1.0 - math.exp(d))
            total += loss * scale
            row_grads.append(grad * scale)
            ratio_sum += ratio
            w_sum += w
        grads.append(row_grads)
    stats = None
    if n:
        stats = {"clip_fraction": clipped / n, "ratio_mean": ratio_sum / n, "kl_mean": k3_sum / n,
                 "tis_weight_mean": w_sum / n, "tis_capped_fraction": capped / n}
    return total, grads, stats


WILD = (-1e3, 1e3, -60.0, 0.0, 45.0, -1e-9)


def _wild(rng: random.Random) -> float:
    # -inf too: it made "reinforce" NaN (test_bug_reinforce_loss_is_nan_when_padding_holds_minus_inf).
    return rng.choice(WILD + (-float("inf"),)) if rng.random() < 0.6 else rng.uniform(-20, 5)


def random_cells(rng: random.Random, length: int, style: str) -> list[tuple]:
    """One row's content: ``(counted, lp, old, ref, prox)`` per column, padding not included."""
    cells = []
    for t in range(length):
        if style == "empty":
            counted = False
        elif style == "full":
            counted = True
        elif style == "tail":
            counted = t >= length // 2
        else:  # multi-turn like: runs of actions and observations
            counted = rng.random() < 0.6
        if counted:
            lp = rng.uniform(-4.0, -0.01)
            old = lp + rng.uniform(-0.6, 0.6)
            ref = lp + rng.uniform(-1.0, 1.0)
            prox = lp + rng.uniform(-0.4, 0.4)
            if rng.random() < 0.1:
                old = lp  # on-policy token
            if rng.random() < 0.1:
                prox = old - rng.uniform(0.8, 2.0)  # behaviour far likelier... weight small
            if rng.random() < 0.1:
                prox = old + rng.uniform(0.8, 2.0)  # capped weight
            cells.append((True, lp, old, ref, prox))
        else:
            cells.append((False, _wild(rng), _wild(rng), _wild(rng), _wild(rng)))
    return cells


def random_rows(rng: random.Random, batch: int, max_len: int) -> list[list[tuple]]:
    rows = []
    for _ in range(batch):
        style = rng.choice(["empty", "full", "tail", "mixed", "mixed", "mixed"])
        rows.append(random_cells(rng, rng.randint(0, max_len), style))
    return rows


def layout(rows: list[list[tuple]], width: int, offsets: list[int], rng: random.Random, dtype=torch.float64):
    """[B, width] tensors (lp, old, ref, prox, mask) with row i's cells starting at column offsets[i];
    the rest is padding holding wild values."""
    b = len(rows)
    fields = [[[_wild(rng) for _ in range(width)] for _ in range(b)] for _ in range(4)]
    mask = [[0.0] * width for _ in range(b)]
    for i, (cells, off) in enumerate(zip(rows, offsets)):
        assert off + len(cells) <= width
        for t, (counted, *vals) in enumerate(cells):
            for f in range(4):
                fields[f][i][off + t] = vals[f]
            mask[i][off + t] = 1.0 if counted else 0.0
    lp, old, ref, prox = (torch.tensor(f, dtype=dtype).view(b, width) for f in fields)
    return lp, old, ref, prox, torch.tensor(mask, dtype=dtype).view(b, width)


def random_options(rng: random.Random) -> dict:
    kind = rng.choice(LOSS_KINDS)
    aggregation = rng.choice(AGGREGATIONS)
    with_ref = rng.random() < 0.6
    kl_coef = rng.choice([0.0, 0.05, 1.0]) if with_ref else 0.0
    with_prox = rng.random() < 0.4
    return {"kind": kind, "aggregation": aggregation, "with_ref": with_ref, "kl_coef": kl_coef, "with_prox": with_prox,
            "clip_eps": rng.choice([0.1, 0.2, 0.28, 0.5]), "tis_cap": rng.choice([1.0, 1.5, 2.0, 5.0])}


def run_loss(lp, old, ref, prox, mask, adv, opts: dict, num_tokens: float, num_sequences: float):
    """policy_loss with ``opts``; returns (loss, d loss / d lp, stats)."""
    lp = lp.clone().requires_grad_()
    loss, stats = policy_loss(
        lp, old, adv, mask, num_tokens=num_tokens, kind=opts["kind"], clip_eps=opts["clip_eps"],
        ref_logprobs=ref if opts["with_ref"] else None, kl_coef=opts["kl_coef"], aggregation=opts["aggregation"],
        num_sequences=num_sequences, proximal_logprobs=prox if opts["with_prox"] else None, tis_cap=opts["tis_cap"],
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad, stats


def counted_entries(rows: list[list[tuple]]) -> list[list[Entry]]:
    return [[tuple(vals) for counted, *vals in cells if counted] for cells in rows]


def ref_for(rows, advs, opts, num_tokens, num_sequences):
    return ref_policy_loss(counted_entries(rows), advs, kind=opts["kind"], clip_eps=opts["clip_eps"],
                           kl_coef=opts["kl_coef"], has_ref=opts["with_ref"], has_prox=opts["with_prox"],
                           tis_cap=opts["tis_cap"], aggregation=opts["aggregation"], num_tokens=num_tokens,
                           num_sequences=num_sequences)


def _grads_at_counted(grad: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [grad[i][mask[i] > 0].tolist() for i in range(grad.shape[0])]


def _random_advantages(rng: random.Random, b: int) -> list[float]:
    return [rng.choice([0.0, 1.0, -1.0, rng.uniform(-3, 3), rng.uniform(-0.1, 0.1)]) for _ in range(b)]


def _counts(rng: random.Random, rows) -> tuple[float, float]:
    """Global counts: this batch's plus other ranks' (any amount)."""
    local_tokens = sum(c[0] for cells in rows for c in cells)
    extra = rng.choice([0, 0, 3, 17])
    return float(max(local_tokens + extra, 1)), float(len(rows) + rng.choice([0, 0, 2, 9]))


@pytest.mark.parametrize("seed", SEEDS)
def test_policy_loss_matches_the_per_token_reference(seed):
    rng = random.Random(2000 + seed)
    for _ in range(12):
        b = rng.randint(1, 6)
        rows = random_rows(rng, b, max_len=7)
        width = max([len(c) for c in rows] + [1]) + rng.randint(0, 2)
        offsets = [rng.randint(0, width - len(c)) for c in rows]
        lp, old, ref, prox, mask = layout(rows, width, offsets, rng)
        advs = _random_advantages(rng, b)
        opts = random_options(rng)
        num_tokens, num_sequences = _counts(rng, rows)
        loss, grad, stats = run_loss(lp, old, ref, prox, mask, torch.tensor(advs, dtype=torch.float64), opts,
                                     num_tokens, num_sequences)
        exp_loss, exp_grads, exp_stats = ref_for(rows, advs, opts, num_tokens, num_sequences)
        ctx = f"opts={opts} advs={advs} rows={rows}"
        assert loss.item() == pytest.approx(exp_loss, rel=1e-9, abs=1e-12), ctx
        got = _grads_at_counted(grad, mask)
        for g_row, e_row in zip(got, exp_grads):
            assert g_row == pytest.approx(e_row, rel=1e-9, abs=1e-12), ctx
        # Padding and observation tokens get no gradient at all.
        assert (grad[mask == 0] == 0).all(), ctx
        assert torch.isfinite(grad).all()
        assert set(stats) == {"clip_fraction", "ratio_mean", "kl_mean", "tis_weight_mean", "tis_capped_fraction"}
        assert all(math.isfinite(v) for v in stats.values()), stats
        if exp_stats is not None:
            assert stats == pytest.approx(exp_stats, rel=1e-9, abs=1e-12), ctx
        else:  # no counted token on this rank
            assert loss.item() == 0.0 and stats["clip_fraction"] == 0.0 and stats["kl_mean"] == 0.0
            assert stats["tis_weight_mean"] == 1.0 and stats["tis_capped_fraction"] == 0.0
        if not opts["with_prox"]:
            assert stats["tis_weight_mean"] == 1.0 and stats["tis_capped_fraction"] == 0.0
        if opts["kind"] == "reinforce":
            assert stats["clip_fraction"] == 0.0
        assert 0.0 <= stats["clip_fraction"] <= 1.0 and stats["kl_mean"] >= 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_policy_loss_invariances(seed):
    rng = random.Random(3000 + seed)
    for _ in range(6):
        b = rng.randint(1, 6)
        rows = random_rows(rng, b, max_len=6)
        longest = max([len(c) for c in rows] + [1])
        advs = _random_advantages(rng, b)
        adv = torch.tensor(advs, dtype=torch.float64)
        opts = random_options(rng)
        num_tokens, num_sequences = _counts(rng, rows)
        args = (opts, num_tokens, num_sequences)

        right = layout(rows, longest, [0] * b, rng)  # right padding
        base_loss, base_grad, base_stats = run_loss(*right, adv, *args)
        base_counted = _grads_at_counted(base_grad, right[4])

        # Padding amount and side: left-padded, right-padded, anywhere in a wider row.
        for width, offsets in (
            (longest, [longest - len(c) for c in rows]),
            (longest + 5, [rng.randint(0, longest + 5 - len(c)) for c in rows]),
        ):
            other = layout(rows, width, offsets, rng)
            loss, grad, stats = run_loss(*other, adv, *args)
            torch.testing.assert_close(loss, base_loss, rtol=1e-12, atol=1e-14)
            for g_row, e_row in zip(_grads_at_counted(grad, other[4]), base_counted):
                assert g_row == pytest.approx(e_row, rel=1e-12, abs=1e-15)
            assert (grad[other[4] == 0] == 0).all()
            assert stats == pytest.approx(base_stats, rel=1e-12, abs=1e-15)

        # Row order: the loss is a sum over samples.
        perm = list(range(b))
        rng.shuffle(perm)
        p_loss, p_grad, p_stats = run_loss(*(x[perm] for x in right), adv[perm], *args)
        torch.testing.assert_close(p_loss, base_loss, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(p_grad, base_grad[perm], rtol=1e-12, atol=1e-15)
        assert p_stats == pytest.approx(base_stats, rel=1e-12, abs=1e-15)

        # Split across ranks with the global counts: the losses and the gradients add up to the
        # whole batch's (the trainer's only accumulation; it multiplies by the world size and DDP
        # averages, which is the same sum). Empty shards included.
        k = rng.randint(1, b + 1)
        owner = [rng.randrange(k) for _ in range(b)]
        total = torch.zeros((), dtype=torch.float64)
        split_grad = torch.zeros_like(base_grad)
        for shard in range(k):
            idx = [i for i in range(b) if owner[i] == shard]
            loss, grad, _ = run_loss(*(x[idx] for x in right), adv[idx], *args)
            total = total + loss
            split_grad[idx] = grad
        torch.testing.assert_close(total, base_loss, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(split_grad, base_grad, rtol=1e-12, atol=1e-15)

        # Whatever padding / observation columns hold, nothing changes.
        lp, old, ref, prox, mask = right
        noisy = [torch.where(mask > 0, x, torch.tensor([_wild(rng) for _ in range(x.numel())], dtype=x.dtype).view_as(x))
                 for x in (lp, old, ref, prox)]
        n_loss, n_grad, n_stats = run_loss(*noisy, mask, adv, *args)
        assert torch.equal(n_loss, base_loss) and torch.equal(n_grad, base_grad) and n_stats == base_stats

        # kl_coef = 0: reference logprobs are reported (kl_mean) but change neither loss nor gradient.
        if opts["kl_coef"] == 0.0:
            flip = dict(opts, with_ref=not opts["with_ref"])
            f_loss, f_grad, f_stats = run_loss(*right, adv, flip, num_tokens, num_sequences)
            assert torch.equal(f_loss, base_loss) and torch.equal(f_grad, base_grad)
            if not flip["with_ref"]:
                assert f_stats["kl_mean"] == 0.0

        # Proximal == behaviour: weight 1, the plain objective exactly.
        if opts["with_prox"]:
            same = (lp, old, ref, old.clone(), mask)
            s_loss, s_grad, s_stats = run_loss(*same, adv, *args)
            plain = dict(opts, with_prox=False)
            q_loss, q_grad, _ = run_loss(*right, adv, plain, num_tokens, num_sequences)
            assert torch.equal(s_loss, q_loss) and torch.equal(s_grad, q_grad)
            assert s_stats["tis_weight_mean"] == 1.0 and s_stats["tis_capped_fraction"] == 0.0

        # Advantages enter linearly (positively homogeneous for the clip) when no KL is added.
        if opts["kl_coef"] == 0.0:
            c = rng.choice([0.5, 2.0, 8.0])
            c_loss, c_grad, _ = run_loss(*right, adv * c, *args)
            torch.testing.assert_close(c_loss, base_loss * c, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(c_grad, base_grad * c, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", SEEDS)
def test_on_policy_clip_equals_reinforce_and_equal_lengths_make_the_aggregations_agree(seed):
    rng = random.Random(4000 + seed)
    b, n = rng.randint(1, 5), rng.randint(1, 6)
    width = n + rng.randint(0, 3)
    rows = [random_cells(rng, n, "full") for _ in range(b)]
    lp, _, ref, _, mask = layout(rows, width, [rng.randint(0, width - n) for _ in range(b)], rng)
    adv = torch.tensor(_random_advantages(rng, b), dtype=torch.float64)
    kl = rng.choice([0.0, 0.1])
    grads, losses = {}, {}
    for kind in LOSS_KINDS:
        for agg in AGGREGATIONS:
            x = lp.clone().requires_grad_()
            loss, stats = policy_loss(x, lp.clone(), adv, mask, num_tokens=float(b * n), num_sequences=float(b), kind=kind,
                                      aggregation=agg, ref_logprobs=ref, kl_coef=kl)
            (grads[kind, agg],) = torch.autograd.grad(loss, x)
            losses[kind, agg] = loss
            assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_fraction"] == 0.0
    for agg in AGGREGATIONS:
        # At ratio 1 the clipped objective's gradient is REINFORCE's (the loss values differ:
        # ratio * A vs logprob * A).
        torch.testing.assert_close(grads["grpo_clip", agg], grads["reinforce", agg], rtol=1e-12, atol=1e-15)
    for kind in LOSS_KINDS:
        # Every sample has n counted tokens: mean of sample means == mean over tokens.
        torch.testing.assert_close(losses[kind, "sequence"], losses[kind, "token"], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grads[kind, "sequence"], grads[kind, "token"], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", SEEDS)
def test_float32_loss_agrees_with_float64(seed):
    # What the trainer runs (logprobs.float()); far from the clip boundaries the two agree closely.
    rng = random.Random(5000 + seed)
    b = rng.randint(1, 6)
    rows = random_rows(rng, b, max_len=6)
    width = max([len(c) for c in rows] + [1])
    t64 = layout(rows, width, [0] * b, rng)
    adv = torch.tensor(_random_advantages(rng, b), dtype=torch.float64)
    opts = random_options(rng)
    num_tokens, num_sequences = _counts(rng, rows)
    l64, _, _ = run_loss(*t64, adv, opts, num_tokens, num_sequences)
    l32, g32, s32 = run_loss(*(x.float() for x in t64), adv.float(), opts, num_tokens, num_sequences)
    assert l32.dtype == torch.float32 and torch.isfinite(g32).all() and all(math.isfinite(v) for v in s32.values())
    # The loss is continuous at the clip boundary (its gradient is not): compare the values only.
    assert l32.item() == pytest.approx(l64.item(), rel=1e-4, abs=1e-5)


# ================================================================================================
# Fetched groups -> tensors (batch_from_groups) and the loss over them
# ================================================================================================

META = json.dumps({"row": {"instance": 1}})
PAD = 0


def random_episode(rng: random.Random, has_prompt: bool) -> tuple[list[int], list[int], list[float]]:
    """(ids, loss mask, logprobs) of one episode: actions (mask 1, logprobs < 0) and observations
    (mask 0, logprob 0). Without a prompt an env episode opens with its first observation."""
    length = rng.randint(0, 8)  # 0: an empty completion
    style = rng.choice(["single", "multi", "multi", "obs_only"])
    ids, mask, lps = [], [], []
    for t in range(length):
        if style == "single":
            trained = 1
        elif style == "obs_only":
            trained = 0
        else:
            trained = int(rng.random() < 0.55)
        if t == 0 and not has_prompt:
            trained = 0  # the first observation (what a real env episode has)
        ids.append(rng.randint(1, 40))
        mask.append(trained)
        lps.append(rng.uniform(-3.0, -0.01) if trained else 0.0)
    return ids, mask, lps


def random_groups(rng: random.Random, num_groups: int, group_size: int, prompts: str) -> list[FetchedGroup]:
    """``prompts``: "none" (env tasks: the episode holds the prompt), "all" (1-4 token prompts), or
    "mixed" (some groups without one)."""
    groups = []
    for g in range(num_groups):
        has_prompt = prompts == "all" or (prompts == "mixed" and rng.random() < 0.5)
        prompt = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))] if has_prompt else []
        samples = []
        for _ in range(group_size):
            # Prompt-less shards ("none") also get plain completions whose first token is an action:
            # with nothing before it, it predicts nothing and must not count.
            ids, mask, lps = random_episode(rng, has_prompt or (prompts == "none" and rng.random() < 0.3))
            # In a shard with prompts, a prompt-less episode's first token was scored from padding:
            # test_bug_a_promptless_episode_first_token_is_scored_from_padding_in_a_shard_with_prompts.
            loss_mask = None if all(mask) and rng.random() < 0.5 else mask
            samples.append(SampleRecord.pack(ids, lps, rng.uniform(-1, 2), text=f"s{len(samples)}", loss_mask=loss_mask,
                                             turns=rng.randint(1, 3), env_s=rng.random(), truncated=rng.random() < 0.2))
        groups.append(FetchedGroup(3, f"t{g}", "n0", 0, 0.0, 0.0, prompt, Split.TRAIN, META, samples))
    return groups


def reference_targets(groups: list[FetchedGroup]) -> list[list[tuple[tuple[int, ...], int, float]]]:
    """Per sample (row order): (context, token, old logprob) of every token the policy must be
    trained on: an action (mask 1) that has a context to be predicted from."""
    out = []
    for g in groups:
        prompt = list(g.prompt_ids)
        for s in g.samples:
            ids, mask, lps = s.token_ids(), s.mask_list(), s.logprob_list()
            seq = prompt + ids
            targets = []
            for j, (tok, m, lp) in enumerate(zip(ids, mask, lps)):
                pos = len(prompt) + j
                if m and pos > 0:
                    targets.append((tuple(seq[:pos]), tok, lp))
            out.append(targets)
    return out


def batch_targets(batch) -> list[list[tuple[tuple[int, ...], int, float]]]:
    """What the batch trains: for each counted column t of each row, (real tokens up to t, token t + 1, old[t])."""
    out = []
    for r in range(batch.tokens.shape[0]):
        toks, valid = batch.tokens[r].tolist(), batch.valid[r].tolist()
        row = []
        for t, m in enumerate(batch.completion_mask[r].tolist()):
            assert m in (0.0, 1.0)
            if m:
                assert valid[t] and valid[t + 1], f"row {r}: column {t} counted but its token or the next is padding"
                ctx = tuple(x for x, v in zip(toks[:t + 1], valid[:t + 1]) if v)
                row.append((ctx, toks[t + 1], batch.old_logprobs[r, t].item()))
        out.append(row)
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_from_groups_trains_exactly_the_policy_tokens_each_scored_from_its_context(seed):
    rng = random.Random(6000 + seed)
    for _ in range(6):
        prompts = rng.choice(["none", "all", "mixed"])
        groups = random_groups(rng, rng.randint(1, 4), rng.randint(1, 4), prompts)
        batch = batch_from_groups(groups, PAD, CPU)
        rows = [(g, s) for g in groups for s in g.samples]
        width = max(len(g.prompt_ids) for g in groups)
        length = max([s.num_tokens for _, s in rows] + [1])
        b = len(rows)
        assert batch.tokens.shape == (b, width + length) and batch.valid.shape == batch.tokens.shape
        assert batch.completion_mask.shape == batch.old_logprobs.shape == (b, width + length - 1)
        assert batch.completion_mask.dtype == batch.old_logprobs.dtype == torch.float32
        for r, (g, s) in enumerate(rows):
            seq = list(g.prompt_ids) + s.token_ids()
            valid = batch.valid[r].tolist()
            start = width - len(g.prompt_ids)
            # One contiguous run of real tokens: the prompt right-aligned at `width`, then the episode.
            assert valid == [False] * start + [True] * len(seq) + [False] * (width + length - start - len(seq))
            assert batch.tokens[r, start:start + len(seq)].tolist() == seq
            assert (batch.tokens[r][~batch.valid[r]] == PAD).all()
        # Alignment: every counted column predicts the next real token from the real tokens before
        # it, with that token's own sampling logprob; observations and prompts never count.
        assert batch_targets(batch) == reference_targets(groups)
        assert float(batch.completion_mask.sum()) == sum(len(t) for t in reference_targets(groups))
        assert batch.rewards.tolist() == _f32([s.reward for _, s in rows])
        assert batch.completions == [s.text for _, s in rows]
        assert batch.episodes == pytest.approx({
            "episodes": float(b), "turns": float(sum(s.turns for _, s in rows)),
            "env_s": sum(s.env_s for _, s in rows), "truncated": float(sum(s.truncated for _, s in rows)),
        })


def ctx_logprob(ctx: tuple[int, ...], token: int, salt: str) -> float:
    """A deterministic "policy": a log-probability that depends on the whole context and the token."""
    h = zlib.crc32(f"{salt}|{ctx}|{token}".encode())
    return -0.02 - (h % 4096) / 1300.0


def model_logprobs(batch, salt: str, rng: random.Random) -> torch.Tensor:
    """[B, T-1] what a padding-aware model gives: column t scores token t + 1 from the real tokens
    up to t; columns that predict padding (or predict from padding only) hold garbage."""
    b, t = batch.tokens.shape
    out = torch.empty(b, t - 1, dtype=torch.float64)
    for r in range(b):
        toks, valid = batch.tokens[r].tolist(), batch.valid[r].tolist()
        for c in range(t - 1):
            if valid[c] and valid[c + 1]:
                ctx = tuple(x for x, v in zip(toks[:c + 1], valid[:c + 1]) if v)
                out[r, c] = ctx_logprob(ctx, toks[c + 1], salt)
            else:
                out[r, c] = _wild(rng)
    return out


def _partition(rng: random.Random, items: list, k: int) -> list[list]:
    parts = [[] for _ in range(k)]
    for x in items:
        parts[rng.randrange(k)].append(x)
    return parts


@pytest.mark.parametrize("seed", SEEDS)
def test_the_loss_of_fetched_groups_is_the_loss_of_their_episodes_whatever_the_shard(seed):
    rng = random.Random(7000 + seed)
    for _ in range(3):
        group_size = rng.choice([1, 2, 3, 4])
        groups = random_groups(rng, rng.randint(1, 5), group_size, rng.choice(["none", "all", "mixed"]))
        opts = random_options(rng)
        name = rng.choice(sorted(ADVANTAGES))
        targets = reference_targets(groups)
        rewards = [s.reward for g in groups for s in g.samples]
        advs = ref_advantages(name, _f32(rewards), group_size)
        num_tokens = float(max(sum(len(t) for t in targets), 1))
        num_sequences = float(len(rewards))
        # The reference: each episode on its own, no padding, only its actions.
        rows = [[(ctx_logprob(c, tok, "pi"), old, ctx_logprob(c, tok, "ref"), ctx_logprob(c, tok, "prox"))
                 for c, tok, old in t] for t in targets]
        exp_loss, exp_grads, _ = ref_policy_loss(
            rows, advs, kind=opts["kind"], clip_eps=opts["clip_eps"], kl_coef=opts["kl_coef"], has_ref=opts["with_ref"],
            has_prox=opts["with_prox"], tis_cap=opts["tis_cap"], aggregation=opts["aggregation"],
            num_tokens=num_tokens, num_sequences=num_sequences)
        # The trainer: shards of whole groups (ranks), each rebuilt, scored and averaged with the global counts.
        index = {id(s): k for k, s in enumerate(s for g in groups for s in g.samples)}
        total, seen = 0.0, set()
        for shard in _partition(rng, groups, rng.randint(1, 3)):
            batch = batch_from_groups(shard, PAD, CPU)
            if batch.tokens.shape[0] == 0:
                continue  # the trainer swaps in a fully masked dummy row: it adds 0
            adv = compute_advantages(name, batch.rewards, group_size)
            assert adv.tolist() == pytest.approx(ref_advantages(name, _f32(batch.rewards.tolist()), group_size),
                                                 abs=_adv_tol(name, batch.rewards.tolist()), rel=1e-4)
            lp, ref, prox = (model_logprobs(batch, salt, rng) for salt in ("pi", "ref", "prox"))
            loss, grad, _ = run_loss(lp, batch.old_logprobs.double(), ref, prox, batch.completion_mask.double(),
                                     adv.double(), opts, num_tokens, num_sequences)
            total += loss.item()
            assert (grad[batch.completion_mask == 0] == 0).all()
            shard_samples = [s for g in shard for s in g.samples]
            for s, g in zip(shard_samples, _grads_at_counted(grad, batch.completion_mask)):
                k = index[id(s)]
                seen.add(k)
                assert g == pytest.approx(exp_grads[k], rel=1e-4, abs=1e-7), (k, opts)
        assert seen == set(range(len(rewards)))
        # Old logprobs are float32 on both sides; advantages are float32 in the trainer.
        assert total == pytest.approx(exp_loss, rel=1e-4, abs=1e-6), opts


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    model = TinyCausalLM(ModelConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=32), 41)
    with torch.no_grad():  # wider weights: logprobs depend visibly on position and context
        for p in model.parameters():
            p.mul_(8.0)
    return model


@pytest.mark.parametrize("seed", SEEDS)
def test_tiny_policy_on_a_fetched_shard_scores_each_episode_as_if_alone(seed, tiny_model):
    rng = random.Random(8000 + seed)
    group_size = rng.choice([1, 2, 3])
    groups = random_groups(rng, rng.randint(1, 3), group_size, rng.choice(["none", "all", "mixed"]))
    batch = batch_from_groups(groups, PAD, CPU)
    with torch.no_grad():
        lp = token_logprobs(tiny_model, batch.tokens, batch.valid)
    rows = [(g, s) for g in groups for s in g.samples]
    for r, (g, s) in enumerate(rows):
        seq = list(g.prompt_ids) + s.token_ids()
        if len(seq) < 2:
            continue
        alone = torch.tensor([seq])
        with torch.no_grad():
            own = token_logprobs(tiny_model, alone, torch.ones_like(alone, dtype=torch.bool))[0]
        start = (max(len(x.prompt_ids) for x in groups)) - len(g.prompt_ids)
        cols = batch.completion_mask[r].nonzero().flatten().tolist()
        for c in cols:
            # Column c of the batch is column c - start of the episode alone.
            assert lp[r, c].item() == pytest.approx(own[c - start].item(), abs=1e-4), (r, c)
    # And the parameter gradient of the whole shard equals the sum over any split into ranks.
    opts = random_options(rng)
    opts.update(with_ref=False, kl_coef=0.0, with_prox=False)
    name = rng.choice(sorted(ADVANTAGES))
    num_tokens = float(max(batch.completion_mask.sum().item(), 1.0))
    num_sequences = float(batch.tokens.shape[0])

    def grads_of(shards) -> list[torch.Tensor]:
        tiny_model.zero_grad()
        for shard in shards:
            bt = batch_from_groups(shard, PAD, CPU)
            if bt.tokens.shape[0] == 0:
                continue
            logp = token_logprobs(tiny_model, bt.tokens, bt.valid)
            loss, _ = policy_loss(logp, bt.old_logprobs, compute_advantages(name, bt.rewards, group_size),
                                  bt.completion_mask, num_tokens=num_tokens, num_sequences=num_sequences,
                                  kind=opts["kind"], aggregation=opts["aggregation"], clip_eps=opts["clip_eps"])
            loss.backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in tiny_model.parameters()]

    whole = grads_of([groups])
    split = grads_of(_partition(rng, groups, rng.randint(2, 3)))
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    tiny_model.zero_grad()


def test_the_dummy_row_of_an_empty_rank_adds_nothing_under_every_option(tiny_model):
    # A rank without groups trains on dummy_batch (one fully masked row) so its collectives still run.
    from elasticrl.train.rollout_link import dummy_batch

    batch = dummy_batch(PAD, CPU)
    adv = compute_advantages("grpo", batch.rewards, 1)
    for kind in LOSS_KINDS:
        for agg in AGGREGATIONS:
            tiny_model.zero_grad()
            logp = token_logprobs(tiny_model, batch.tokens, batch.valid)
            loss, stats = policy_loss(logp, batch.old_logprobs, adv, batch.completion_mask, num_tokens=7.0, num_sequences=3.0,
                                      kind=kind, aggregation=agg, ref_logprobs=logp.detach() - 5.0, kl_coef=0.5,
                                      proximal_logprobs=logp.detach() + 9.0)
            loss.backward()
            assert loss.item() == 0.0 and all(math.isfinite(v) for v in stats.values())
            assert all(p.grad is None or (p.grad == 0).all() for p in tiny_model.parameters())
    tiny_model.zero_grad()


# ================================================================================================
# Bugs this file found (fixed): each test failed on the code before its fix
# ================================================================================================


def test_bug_grpo_flat_group_of_a_non_dyadic_reward_gets_nonzero_advantage():
    # group_advantages: "A group whose samples all scored the same gets zero advantage (it carries
    # no signal), never NaN." 2/3 is what the toy tasks' positional reward gives 2 of 3 digits.
    for value, size in ((0.7, 8), (2 / 3, 8), (3.580493746949883, 9)):
        adv = compute_advantages("grpo", torch.full((size,), value), size)
        assert adv.tolist() == [0.0] * size, (value, size, adv.tolist())


def test_bug_reinforce_loss_is_nan_when_padding_holds_minus_inf():
    # loss.py: "padding may hold any log-probability" (and grpo_clip copes: it selects with
    # torch.where); reinforce computes -logprob * A and multiplies by the mask: -inf * 0 = NaN.
    logprobs = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0]])
    clip, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask, num_tokens=1.0, kind="grpo_clip")
    assert clip.item() == -1.0
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask, num_tokens=1.0, kind="reinforce")
    assert loss.item() == 1.0


def test_bug_a_promptless_episode_first_token_is_scored_from_padding_in_a_shard_with_prompts():
    # "The first token of an episode without a prompt predicts nothing": alone it is not counted;
    # next to a group with a 2-token prompt it is counted at column 1, predicted from a pad
    # (valid False), so the loss of a group depends on which groups share its shard.
    alone = FetchedGroup(1, "a", "n0", 0, 0.0, 0.0, [], Split.TRAIN, META, [SampleRecord.pack([3, 4], [-0.5, -0.25], 1.0)])
    prompted = FetchedGroup(1, "b", "n0", 0, 0.0, 0.0, [1, 2], Split.TRAIN, META, [SampleRecord.pack([5], [-1.0], 0.0)])
    assert batch_from_groups([alone], PAD, CPU).completion_mask.sum().item() == 1.0
    mixed = batch_from_groups([alone, prompted], PAD, CPU)
    assert batch_targets(mixed) == reference_targets([alone, prompted])


def test_bug_sample_groups_old_logprobs_ignore_the_temperature(tiny_model):
    # RolloutBatch.old_logprobs: "log-probabilities of the tokens under the sampling policy"; the
    # trainer compares them with token_logprobs(..., temperature=rollout.temperature), and the
    # tiny engine reports log_softmax(logits / T).
    from elasticrl.policy.vocab import CharVocab
    from elasticrl.rl.rollout import sample_groups
    from elasticrl.rl.tasks import make_task

    vocab, task = CharVocab(), make_task("reverse", 3)
    batch = sample_groups(tiny_model, vocab, task, task.sample(random.Random(0), 2), group_size=2,
                          max_new_tokens=task.max_new_tokens, temperature=0.5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        at_t = token_logprobs(tiny_model, batch.tokens, batch.valid, temperature=0.5)
    m = batch.completion_mask
    torch.testing.assert_close(batch.old_logprobs * m, at_t * m, atol=1e-5, rtol=0)
