"""Token-level policy-gradient objectives without a KL term: clipped-ratio GRPO and plain REINFORCE.

Both average over every completion token in the *global* batch (``num_tokens`` is the all-reduced
token count), so long and short completions weigh per token and the result does not depend on how
samples were split across ranks. The caller multiplies by the world size when DDP averages the
gradients of the ranks.
"""

from __future__ import annotations

import torch


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_tokens: float,
    kind: str = "grpo_clip",
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss to minimize and a few statistics.

    logprobs:     [B, T] log-probability of each sampled token under the current policy (with grad).
    old_logprobs: [B, T] the same under the policy that sampled them (no grad).
    advantages:   [B] one advantage per sample, broadcast to its tokens.
    mask:         [B, T] 1.0 on completion tokens that count, 0.0 on prompt and padding.
    num_tokens:   the number of counted tokens in the global batch (sum of every rank's mask).
    kind:         "grpo_clip": -min(ratio * A, clip(ratio, 1 +- eps) * A);
                  "reinforce": -logprob * A (the ratio's gradient at ratio 1, never clipped).
    """
    assert logprobs.shape == old_logprobs.shape == mask.shape, (
        f"shapes differ: logprobs {tuple(logprobs.shape)}, old {tuple(old_logprobs.shape)}, mask {tuple(mask.shape)}"
    )
    assert advantages.shape == logprobs.shape[:1], f"advantages {tuple(advantages.shape)} must be [B={logprobs.shape[0]}]"
    assert num_tokens > 0, f"num_tokens must be > 0, got {num_tokens}"
    adv = advantages.detach().unsqueeze(1)  # [B, 1]
    mask = mask.to(logprobs.dtype)
    if kind == "reinforce":
        per_token = -logprobs * adv
        clipped = torch.zeros_like(mask)
        ratio = torch.ones_like(logprobs)
    elif kind == "grpo_clip":
        ratio = torch.exp(logprobs - old_logprobs.detach())
        unclipped = ratio * adv
        bounded = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
        per_token = -torch.minimum(unclipped, bounded)
        clipped = (bounded < unclipped).to(mask.dtype)
    else:
        raise ValueError(f"kind: {kind!r} is not one of grpo_clip, reinforce")
    loss = (per_token * mask).sum() / num_tokens
    local_tokens = mask.sum().clamp(min=1.0)
    stats = {
        "clip_fraction": float((clipped * mask).sum() / local_tokens),
        "ratio_mean": float((ratio.detach() * mask).sum() / local_tokens),
    }
    return loss, stats
