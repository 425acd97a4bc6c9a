"""Sampling GRPO groups from the local policy and scoring them with the task's reward.

One ``RolloutBatch`` holds a rank's share of an iteration: ``group_size`` samples of each of its
prompts, contiguous per prompt (what ``group_advantages`` expects), as left-padded token rows with
the masks the loss needs.
"""

from __future__ import annotations

import dataclasses

import torch

from elasticrl.policy.tiny import token_logprobs
from elasticrl.policy.vocab import CharVocab
from elasticrl.rl.tasks import Example, Task


@dataclasses.dataclass
class RolloutBatch:
    tokens: torch.Tensor
    """[B, T] prompt (left-padded) then completion (right-padded after EOS)."""
    valid: torch.Tensor
    """[B, T] bool, False on padding."""
    completion_mask: torch.Tensor
    """[B, T-1] float, 1.0 where position t predicts a completion token (EOS included)."""
    old_logprobs: torch.Tensor
    """[B, T-1] log-probabilities of the tokens under the sampling policy."""
    rewards: torch.Tensor
    """[B] reward of each sample."""
    completions: list[str]
    examples: list[Example]
    """[B] the example each sample answers (each prompt repeated group_size times)."""
    episodes: dict[str, float] = dataclasses.field(default_factory=dict)
    """Sums over the batch's episodes: "episodes", "turns", "env_s" (seconds in the env),
    "truncated" (count); empty for locally sampled batches."""


@torch.no_grad()
def sample_groups(
    model: torch.nn.Module,
    vocab: CharVocab,
    task: Task,
    examples: list[Example],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> RolloutBatch:
    """Draw ``group_size`` completions per example, score them, and record the sampling logprobs.

    Tensors are made on the model's device; ``generator`` must live there too.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    repeated = [ex for ex in examples for _ in range(group_size)]
    prompts = [vocab.encode(ex.prompt, bos=True) for ex in repeated]
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), vocab.pad_id, dtype=torch.long)
    for row, ids in enumerate(prompts):
        tokens[row, width - len(ids):] = torch.tensor(ids)
    tokens = tokens.to(device)
    valid = tokens != vocab.pad_id
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    # No KV cache: sequences are a few dozen tokens, and recomputing keeps the model trivial.
    for _ in range(max_new_tokens):
        logits = model(tokens, valid)[:, -1, :].float() / temperature  # [B, V]
        logits[:, vocab.pad_id] = float("-inf")
        logits[:, vocab.bos_id] = float("-inf")
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)  # [B]
        nxt = torch.where(done, torch.full_like(nxt, vocab.pad_id), nxt)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        valid = torch.cat([valid, (~done)[:, None]], dim=1)
        done |= nxt == vocab.eos_id
        if bool(done.all()):
            break
    completion_mask = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, device=device)
    completion_mask[:, width - 1:] = valid[:, width:].float()
    old_logprobs = token_logprobs(model, tokens, valid, temperature=temperature)
    completions = [vocab.decode(row) for row in tokens[:, width:].tolist()]
    rewards = torch.tensor([task.reward(ex, text) for ex, text in zip(repeated, completions)], device=device)
    model.train(was_training)
    return RolloutBatch(tokens, valid, completion_mask, old_logprobs, rewards, completions, repeated)
