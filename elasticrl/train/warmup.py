"""The supervised warm-up before RL: teach a fresh policy the answer format (``trainer.warmup_steps``).

A from-scratch policy almost never emits a well-formed answer, so GRPO's group-relative
advantages start near zero everywhere. A few teacher-forced steps on (prompt, target) pairs of
the task give it the format (digits, then EOS) and leave the task itself to RL. Each rank draws
its own examples from a seed of (run seed, step, rank); the loss is summed over ranks' tokens.
"""

from __future__ import annotations

import logging
import random
import time

import torch

from elasticrl.train.dist import WorldInfo, all_reduce_sum

log = logging.getLogger(__name__)


def supervised_warmup(parts, strategy, task, *, steps: int, batch_size: int, seed: int, world: WorldInfo,
                      device: torch.device) -> float:
    """``steps`` optimizer steps of next-token loss on the targets; returns the mean global loss.

    ``parts``: the node's ``PolicyParts``; ``strategy``: its wrapped training strategy;
    ``batch_size``: examples per step over all ranks.
    """
    per_rank = max(1, batch_size // world.world_size)
    t0 = time.monotonic()
    loss_sum = 0.0
    for step in range(steps):
        examples = task.sample(random.Random(f"{seed}/warmup/{step}/{world.rank}"), per_rank)
        prompts = [parts.encode_prompt(ex.prompt) for ex in examples]
        answers = [parts.encode_answer(ex.target) for ex in examples]
        width, length = max(map(len, prompts)), max(map(len, answers))
        # Prompts left-padded to one width, answers right after them; mask[r, t] scores token t + 1.
        tokens = torch.full((len(examples), width + length), parts.pad_id, dtype=torch.long)  # [B, T]
        valid = torch.zeros_like(tokens, dtype=torch.bool)
        mask = torch.zeros(len(examples), width + length - 1)  # [B, T - 1]
        for r, (p, a) in enumerate(zip(prompts, answers)):
            tokens[r, width - len(p):width + len(a)] = torch.tensor(p + a)
            valid[r, width - len(p):width + len(a)] = True
            mask[r, width - 1:width - 1 + len(a)] = 1.0
        (num_tokens,) = all_reduce_sum([float(mask.sum())])
        with strategy.autocast():
            logprobs = parts.logprobs(strategy.module, tokens.to(device), valid.to(device))
        loss = -(logprobs.float() * mask.to(device)).sum() / num_tokens
        strategy.backward(loss * world.world_size)  # gradients are averaged over ranks
        strategy.step()
        (global_loss,) = all_reduce_sum([loss.item()])
        loss_sum += global_loss
        if world.rank == 0 and (step + 1) % max(1, steps // 4) == 0:
            print(f"warm-up {step + 1:>4}/{steps}  supervised loss {global_loss:.4f}", flush=True)
    mean = loss_sum / max(steps, 1)
    log.info("warm-up: %d supervised steps in %.1fs, mean loss %.4f", steps, time.monotonic() - t0, mean)
    return mean
