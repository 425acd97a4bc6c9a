"""policy_loss: gradients of REINFORCE and clipped GRPO, masking and global token normalization."""

from __future__ import annotations

import pytest
import torch

from elasticrl.rl.loss import policy_loss


def _inputs():
    torch.manual_seed(0)
    logprobs = (-torch.rand(3, 4)).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0, 0.5])
    return logprobs, mask, adv


def test_reinforce_gradient_is_minus_advantage_over_tokens():
    logprobs, mask, adv = _inputs()
    loss, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, num_tokens=8.0, kind="reinforce")
    loss.backward()
    assert torch.allclose(logprobs.grad, -adv[:, None] * mask / 8.0)


def test_grpo_clip_on_policy_has_the_reinforce_gradient():
    logprobs, mask, adv = _inputs()
    loss, stats = policy_loss(logprobs, logprobs.detach(), adv, mask, num_tokens=8.0, kind="grpo_clip")
    loss.backward()
    # d/dlogp of ratio * A at ratio 1 is A: the same as REINFORCE.
    assert torch.allclose(logprobs.grad, -adv[:, None] * mask / 8.0)
    assert stats["clip_fraction"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.0)


def test_grpo_clip_stops_the_gradient_once_the_ratio_left_the_trust_region():
    old = torch.zeros(2, 1)
    # Sample 0: ratio e^0.5 ~ 1.65 with A > 0 -> clipped (no further push up).
    # Sample 1: ratio e^0.5 with A < 0 -> unclipped branch is the minimum, gradient flows.
    logprobs = torch.full((2, 1), 0.5, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    loss, stats = policy_loss(logprobs, old, adv, torch.ones(2, 1), num_tokens=2.0, clip_eps=0.2)
    loss.backward()
    assert logprobs.grad[0, 0] == 0.0
    assert logprobs.grad[1, 0] == pytest.approx(torch.exp(torch.tensor(0.5)).item() / 2.0)
    assert stats["clip_fraction"] == pytest.approx(0.5)


def test_masked_tokens_contribute_nothing():
    logprobs, mask, adv = _inputs()
    noisy = logprobs.detach().clone()
    noisy[mask == 0] = -50.0  # wildly different log-probabilities where the mask is zero
    a, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, num_tokens=8.0)
    b, _ = policy_loss(logprobs, noisy, adv, mask, num_tokens=8.0)
    assert torch.allclose(a, b)


def test_ranks_sharing_a_global_token_count_sum_to_the_full_batch_loss():
    logprobs, mask, adv = _inputs()
    old = logprobs.detach() - 0.1
    full, _ = policy_loss(logprobs, old, adv, mask, num_tokens=float(mask.sum()))
    parts = [
        policy_loss(logprobs[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], num_tokens=float(mask.sum()))[0]
        for i in range(3)
    ]
    assert torch.allclose(full, sum(parts))


def test_bad_arguments_are_refused():
    logprobs, mask, adv = _inputs()
    with pytest.raises(ValueError, match="grpo_clip, reinforce"):
        policy_loss(logprobs, logprobs, adv, mask, num_tokens=1.0, kind="ppo")
    with pytest.raises(AssertionError, match="num_tokens"):
        policy_loss(logprobs, logprobs, adv, mask, num_tokens=0.0)
    with pytest.raises(AssertionError, match="advantages"):
        policy_loss(logprobs, logprobs, adv[:2], mask, num_tokens=1.0)
