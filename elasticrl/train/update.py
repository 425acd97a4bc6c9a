"""The policy update of one iteration: ``trainer.updates_per_iteration`` optimizer steps on this
rank's rows, each step in micro-batches of at most ``trainer.micro_batch_rows`` rows.

A rank's rows went through one forward at once before, which materializes fp32 logits of
``[rows, T, vocab]`` (plus the reference pass and the backward): 160 GB at 64 rows of 4096 tokens
and a 152k vocabulary. Micro-batches bound that to ``micro_batch_rows`` rows; their gradients are
summed (all but the last backward inside ``no_sync()``) and one optimizer step follows, which is
the same step: the loss is normalized by the global token (or sample) count, so a micro-batch's
loss is its share of the rank's, and the losses add up.

Every rank runs the same number of micro-batches, agreed with one all-reduce (FSDP2 gathers
parameters in every forward and backward, a collective): a rank with fewer rows runs empty ones,
a fully masked row whose loss is zero, as a rank without rows always did.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from elasticrl.config import NodeConfig
from elasticrl.rl.advantages import compute_advantages
from elasticrl.rl.loss import policy_loss
from elasticrl.rl.rollout import RolloutBatch
from elasticrl.train.dist import all_reduce_int
from elasticrl.train.rollout_link import dummy_batch

# What an update reports, summed over its optimizer steps and averaged over ranks (rl/loss.py).
UPDATE_STATS = ("loss", "clip_fraction", "kl", "grad_norm", "tis_weight_mean", "tis_capped_fraction")
# policy_loss's per-token means of this rank, combined over micro-batches by their token shares.
_TOKEN_STATS = {"clip_fraction": "clip_fraction", "kl": "kl_mean", "tis_weight_mean": "tis_weight_mean",
                "tis_capped_fraction": "tis_capped_fraction"}


def micro_batch_bounds(rows: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous row ranges covering ``rows`` rows, as equal as they come (some empty
    when ``rows < count``)."""
    return [(rows * i // count, rows * (i + 1) // count) for i in range(count)]


def micro_batch_count(rows: int, micro_batch_rows: int) -> int:
    """How many micro-batches every rank runs: the most any rank needs (a collective when
    ``micro_batch_rows`` is set; 1, and no collective, when it is 0)."""
    if micro_batch_rows <= 0:
        return 1
    return max(1, all_reduce_int(-(-rows // micro_batch_rows), dist.ReduceOp.MAX))


def update(cfg: NodeConfig, strategy, parts, reference: torch.nn.Module | None, batch: RolloutBatch, *,
           num_tokens: float, num_samples: float, world: int, pad_id: int) -> dict[str, float]:
    """``updates_per_iteration`` optimizer steps on ``batch``; returns sums over this rank's steps,
    already scaled so that summing over ranks gives the global values. *Collective.*"""
    a = cfg.algorithm
    rows = batch.tokens.shape[0]
    advantages = compute_advantages(a.advantage, batch.rewards, cfg.task.group_size) if rows else None
    count = micro_batch_count(rows, cfg.trainer.micro_batch_rows)
    micro = []  # (batch, advantages, counted tokens) per micro-batch
    for lo, hi in micro_batch_bounds(rows, count):
        if hi > lo:
            part = RolloutBatch(batch.tokens[lo:hi], batch.valid[lo:hi], batch.completion_mask[lo:hi],
                                batch.old_logprobs[lo:hi], batch.rewards[lo:hi], batch.completions[lo:hi], batch.examples[lo:hi])
            micro.append((part, advantages[lo:hi], float(part.completion_mask.sum())))
        else:  # this rank has fewer rows than the others' micro-batches: an empty one (zero loss)
            empty = dummy_batch(pad_id, strategy.device)
            micro.append((empty, compute_advantages(a.advantage, empty.rewards, 1), 0.0))
    counted = sum(c for _, _, c in micro)
    shares = [c / counted if counted else 1.0 / len(micro) for _, _, c in micro]
    # The engines report logprobs of the distribution they sampled from, log_softmax(logits / T):
    # the ratio and the KL compare like with like only at the same temperature.
    temperature = cfg.rollout.temperature
    refs = [None] * len(micro)
    if reference is not None:
        with torch.no_grad():
            refs = [parts.logprobs(reference, b.tokens, b.valid, temperature=temperature).float() for b, _, _ in micro]
    sums = dict.fromkeys(UPDATE_STATS, 0.0)
    # rollout.max_staleness >= 1, or an update phase (every group drawn by an older policy): the
    # decoupled objective (rl/loss.py); the proximal policy is this update's start, i.e. the first
    # step's logprobs before its optimizer step (no extra forward).
    off_policy = cfg.rollout.max_staleness > 0 or cfg.run.rl_phase == "update"
    decoupled = off_policy and a.off_policy_correction == "tis"
    proximal: list[torch.Tensor | None] = [None] * len(micro)
    for _ in range(cfg.trainer.updates_per_iteration):
        for i, (b, adv, _) in enumerate(micro):
            # Gradients are synchronized once per step, on the last micro-batch's backward.
            with strategy.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                with strategy.autocast():
                    logprobs = parts.logprobs(strategy.module, b.tokens, b.valid, temperature=temperature)
                if decoupled and proximal[i] is None:
                    proximal[i] = logprobs.detach().float()
                loss, stats = policy_loss(
                    logprobs.float(), b.old_logprobs, adv, b.completion_mask,
                    num_tokens=max(num_tokens, 1.0), kind=a.loss, clip_eps=a.clip_eps,
                    ref_logprobs=refs[i], kl_coef=a.kl_coef, aggregation=a.aggregation, num_sequences=max(num_samples, 1.0),
                    proximal_logprobs=proximal[i], tis_cap=a.tis_cap,
                )
                # Gradients are averaged over ranks; each rank's loss is its share of the global loss.
                strategy.backward(loss * world)
            sums["loss"] += loss.detach().item()
            for key, stat in _TOKEN_STATS.items():
                sums[key] += stats[stat] * shares[i] / world
        sums["grad_norm"] += strategy.step().get("grad_norm", 0.0) / world
    return sums
