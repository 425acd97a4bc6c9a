"""Policy-gradient objectives: clipped-ratio GRPO and plain REINFORCE, with an optional KL penalty
to a frozen reference policy and a choice of how tokens are averaged.

The loss is a share of a *global* batch mean: ``num_tokens`` (token aggregation) or
``num_sequences`` (sequence aggregation) is the all-reduced count over every rank, so summing every
rank's loss gives the loss of the whole batch and the result does not depend on how samples were
split across ranks. The caller multiplies by the world size when DDP averages the gradients of the
ranks. Pure torch: the counts come in as numbers, nothing here talks to other ranks.

Aggregations:

* ``"token"``: every counted token weighs the same, so long completions weigh more per sample
  (Dr. GRPO's and DAPO's choice).
* ``"sequence"``: each sample's tokens are averaged first, then samples weigh the same (the
  original GRPO paper's ``1/|o_i|`` per-sample mean).

The KL penalty uses the k3 estimator of KL(policy || reference) per token,
``exp(ref - logp) - (ref - logp) - 1`` (Schulman's "Approximating KL Divergence"; DeepSeekMath's
GRPO): non-negative for every token, unbiased under samples from the policy, and added to the
per-token loss as ``kl_coef * k3``.

Off-policy correction (``proximal_logprobs``, used with ``rollout.max_staleness >= 1``): samples
drawn by a *behaviour* policy up to k versions older than the trainer's. The decoupled objective of
Hilton et al. 2022 ("Batch size-invariance for policy optimization"), as AReaL (Fu et al. 2025) uses
it for asynchronous RL, separates the two roles ``old_logprobs`` plays in PPO: the trust region is
centred on the *proximal* policy (the trainer's policy before this update's first optimizer step),
``ratio = pi / pi_prox`` clipped as usual, and the gap between behaviour and proximal is corrected
by a per-token importance weight ``w = pi_prox / pi_behaviour``, truncated at ``tis_cap`` (truncated
importance sampling as in IMPALA, Espeholt et al. 2018, and for LLM rollouts Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"): the truncation bounds the
variance a very unlikely behaviour token could add. When behaviour and proximal agree, ``w = 1``
and the objective is the plain one.
"""

from __future__ import annotations

import torch

LOSS_KINDS: tuple[str, ...] = ("grpo_clip", "reinforce")
AGGREGATIONS: tuple[str, ...] = ("token", "sequence")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_tokens: float | None = None,
    kind: str = "grpo_clip",
    clip_eps: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "token",
    num_sequences: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss to minimize and a few statistics.

    logprobs:      [B, T] log-probability of each sampled token under the current policy (with grad).
    old_logprobs:  [B, T] the same under the policy that sampled them (no grad).
    advantages:    [B] one advantage per sample, broadcast to its tokens.
    mask:          [B, T] 1.0 on completion tokens that count, 0.0 on prompt and padding.
    num_tokens:    the number of counted tokens in the global batch (sum of every rank's mask);
                   required by ``aggregation="token"``.
    kind:          "grpo_clip": -min(ratio * A, clip(ratio, 1 +- eps) * A);
                   "reinforce": -logprob * A (the ratio's gradient at ratio 1, never clipped).
    clip_eps:      half-width of the trust region of "grpo_clip".
    ref_logprobs:  [B, T] the same tokens under the frozen reference policy (no grad), or None.
    kl_coef:       weight of the per-token k3 KL penalty; > 0 needs ``ref_logprobs``.
    aggregation:   "token" (sum over counted tokens / num_tokens) or "sequence" (each sample's
                   token mean, summed, / num_sequences).
    num_sequences: the number of samples in the global batch (sum of every rank's B); required by
                   ``aggregation="sequence"``. A sample with no counted token adds 0 but still counts.
    proximal_logprobs: [B, T] the same tokens under the trainer's policy before this update's first
                   optimizer step (no grad), or None. Given: the decoupled objective (module
                   docstring): the ratio is taken against these, and every token's loss is weighted
                   by min(exp(proximal - old), tis_cap), ``old_logprobs`` being the behaviour
                   policy's. None: the plain objective, ratio against ``old_logprobs``.
    tis_cap:       the truncation of that importance weight (>= 1).

    Stats (this rank's counted tokens): ``clip_fraction``, ``ratio_mean``, ``kl_mean`` (mean k3
    to the reference, 0.0 without one; the trainer builds a reference only with ``kl_coef`` > 0), ``tis_weight_mean``
    and ``tis_capped_fraction`` (1.0 and 0.0 without ``proximal_logprobs``).

    Raises:
        ValueError: unknown ``kind`` or ``aggregation``, a missing count for the aggregation, or
            ``kl_coef`` > 0 without ``ref_logprobs``.
    """
    if kind not in LOSS_KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(LOSS_KINDS)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
    if aggregation == "token" and num_tokens is None:
        raise ValueError("num_tokens: aggregation='token' needs the global number of counted tokens (the all-reduced mask sum)")
    if aggregation == "sequence" and num_sequences is None:
        raise ValueError("num_sequences: aggregation='sequence' needs the global number of samples (the all-reduced batch size)")
    if kl_coef < 0:
        raise ValueError(f"kl_coef: {kl_coef} must be >= 0 (0 turns the KL penalty off)")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(
            f"kl_coef: {kl_coef} > 0 needs ref_logprobs (the reference policy's log-probabilities); pass them or set kl_coef=0"
        )
    assert logprobs.shape == old_logprobs.shape == mask.shape, (
        f"shapes differ: logprobs {tuple(logprobs.shape)}, old {tuple(old_logprobs.shape)}, mask {tuple(mask.shape)}"
    )
    assert ref_logprobs is None or ref_logprobs.shape == logprobs.shape, (
        f"ref_logprobs {tuple(ref_logprobs.shape)} must match logprobs {tuple(logprobs.shape)}"
    )
    assert proximal_logprobs is None or proximal_logprobs.shape == logprobs.shape, (
        f"proximal_logprobs {tuple(proximal_logprobs.shape)} must match logprobs {tuple(logprobs.shape)}"
    )
    if proximal_logprobs is not None and not tis_cap >= 1.0:
        raise ValueError(f"tis_cap: {tis_cap} must be >= 1 (it caps pi_prox / pi_behaviour)")
    assert advantages.shape == logprobs.shape[:1], f"advantages {tuple(advantages.shape)} must be [B={logprobs.shape[0]}]"
    if aggregation == "token":
        assert num_tokens > 0, f"num_tokens must be > 0, got {num_tokens}"
    else:
        assert num_sequences > 0, f"num_sequences must be > 0, got {num_sequences}"

    adv = advantages.detach().unsqueeze(1)  # [B, 1]
    counted = mask > 0  # [B, T]
    mask = mask.to(logprobs.dtype)
    # Log-ratios are zeroed where the mask is 0 *before* exp: padding may hold any log-probability,
    # and exp(huge) * 0 would be NaN in the loss and in its gradient.
    anchor = old_logprobs if proximal_logprobs is None else proximal_logprobs  # the trust region's centre
    if kind == "reinforce":
        per_token = -logprobs * adv
        clipped = torch.zeros_like(mask)
        ratio = torch.ones_like(logprobs)
    else:  # grpo_clip
        ratio = torch.exp(torch.where(counted, logprobs - anchor.detach(), 0.0))
        unclipped = ratio * adv
        bounded = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
        per_token = -torch.minimum(unclipped, bounded)
        clipped = (bounded < unclipped).to(mask.dtype)
    if proximal_logprobs is not None:
        # Truncated importance weight of the behaviour policy's tokens, a constant (no gradient).
        behaviour = torch.exp(torch.where(counted, proximal_logprobs.detach() - old_logprobs.detach(), 0.0))
        weight = behaviour.clamp(max=tis_cap)
        per_token = per_token * weight
        capped = (behaviour > tis_cap).to(mask.dtype)
    else:
        weight, capped = torch.ones_like(mask), torch.zeros_like(mask)
    if ref_logprobs is not None:
        delta = torch.where(counted, ref_logprobs.detach() - logprobs, 0.0)  # log(p_ref / p)
        k3 = torch.exp(delta) - delta - 1.0  # >= 0, 0 exactly where the policies agree
        if kl_coef > 0:
            per_token = per_token + kl_coef * k3
    else:
        k3 = torch.zeros_like(mask)

    masked = torch.where(counted, per_token, 0.0) * mask  # [B, T]; selected: padding's -inf * 0 is NaN
    if aggregation == "token":
        loss = masked.sum() / num_tokens
    else:
        per_sample = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # [B] token mean of each sample
        loss = per_sample.sum() / num_sequences
    local_tokens = mask.sum().clamp(min=1.0)
    stats = {
        "clip_fraction": float((clipped * mask).sum() / local_tokens),
        "ratio_mean": float((ratio.detach() * mask).sum() / local_tokens),
        "kl_mean": float((k3.detach() * mask).sum() / local_tokens),
        "tis_weight_mean": float((weight * mask).sum() / local_tokens) if mask.sum() > 0 else 1.0,
        "tis_capped_fraction": float((capped * mask).sum() / local_tokens),
    }
    return loss, stats
