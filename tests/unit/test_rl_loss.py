"""policy_loss: REINFORCE and clipped GRPO gradients, masking, the k3 KL penalty, token and sequence aggregation."""

from __future__ import annotations

import math

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


# --- KL to a frozen reference (k3) ------------------------------------------------------------


def test_k3_is_zero_where_the_policy_equals_the_reference():
    logprobs, mask, adv = _inputs()
    plain, plain_stats = policy_loss(logprobs, logprobs.detach(), adv, mask, num_tokens=8.0)
    (plain_grad,) = torch.autograd.grad(plain, logprobs)
    with_kl, stats = policy_loss(
        logprobs, logprobs.detach(), adv, mask, num_tokens=8.0, ref_logprobs=logprobs.detach(), kl_coef=0.5
    )
    (kl_grad,) = torch.autograd.grad(with_kl, logprobs)
    assert stats["kl_mean"] == 0.0 and plain_stats["kl_mean"] == 0.0
    assert torch.allclose(with_kl, plain) and torch.allclose(kl_grad, plain_grad)


def test_k3_values_and_the_penalty_added_to_the_token_mean():
    # Zero advantages leave only the penalty. log(p_ref/p) = +ln 2 -> k3 = 2 - ln 2 - 1;
    # log(p_ref/p) = -ln 2 -> k3 = 1/2 + ln 2 - 1. The third token is padding with a wild reference.
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0 + math.log(2), -1.0 - math.log(2), 500.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = policy_loss(
        logprobs, logprobs.detach(), torch.zeros(1), mask, num_tokens=2.0, ref_logprobs=ref, kl_coef=0.1
    )
    k3 = [1 - math.log(2), math.log(2) - 0.5]
    assert stats["kl_mean"] == pytest.approx(sum(k3) / 2)
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2)
    loss.backward()
    # d k3 / d logp = 1 - p_ref / p: -1 for the first token, +1/2 for the second, 0 on padding.
    assert logprobs.grad.tolist()[0] == pytest.approx([0.1 * -1.0 / 2, 0.1 * 0.5 / 2, 0.0])


def test_kl_penalty_pulls_the_policy_toward_the_reference():
    ref = torch.tensor([[-2.0, -0.5, -1.0]])
    logprobs = torch.tensor([[-0.5, -2.0, -1.0]], requires_grad=True)
    mask = torch.ones(1, 3)
    distance = (logprobs - ref).abs().sum().item()
    for _ in range(20):
        loss, stats = policy_loss(
            logprobs, logprobs.detach(), torch.zeros(1), mask, num_tokens=3.0, ref_logprobs=ref, kl_coef=1.0
        )
        (grad,) = torch.autograd.grad(loss, logprobs)
        assert grad[0, 0] > 0 > grad[0, 1] and grad[0, 2] == 0  # above the reference: push down, below: up
        with torch.no_grad():
            logprobs -= 0.5 * grad
        new_distance = (logprobs - ref).abs().sum().item()
        assert new_distance < distance
        distance = new_distance
    assert distance < 0.5


def test_kl_is_reported_but_not_added_when_its_coefficient_is_zero():
    logprobs, mask, adv = _inputs()
    plain, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, num_tokens=8.0)
    loss, stats = policy_loss(logprobs, logprobs.detach(), adv, mask, num_tokens=8.0, ref_logprobs=logprobs.detach() - 0.3)
    assert torch.allclose(loss, plain)
    assert stats["kl_mean"] == pytest.approx(math.exp(-0.3) + 0.3 - 1.0, rel=1e-5)


def test_wild_log_probabilities_on_padding_give_no_nan():
    logprobs, mask, adv = _inputs()
    old = logprobs.detach().clone()
    ref = logprobs.detach().clone()
    old[mask == 0] = -1000.0  # ratio exp(+1000) would overflow to inf, and inf * 0 is NaN
    ref[mask == 0] = 1000.0
    loss, stats = policy_loss(logprobs, old, adv, mask, num_tokens=8.0, ref_logprobs=ref, kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert all(math.isfinite(v) for v in stats.values())
    assert (logprobs.grad[mask == 0] == 0).all()


# --- aggregation ------------------------------------------------------------------------------


def _two_lengths():
    # Sample 0: one counted token; sample 1: three. REINFORCE per-token loss is -logp * A.
    logprobs = torch.tensor([[-1.0, 0.0, 0.0], [-0.5, -1.0, -1.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -2.0])
    return logprobs, mask, adv


def test_sequence_aggregation_averages_each_sample_then_the_samples():
    logprobs, mask, adv = _two_lengths()
    seq, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, kind="reinforce", aggregation="sequence", num_sequences=2.0)
    tok, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, kind="reinforce", num_tokens=4.0)
    # Sample means: 1.0 and mean(-1, -2, -3) = -2 -> (1 - 2) / 2. Tokens: (1 - 1 - 2 - 3) / 4.
    assert seq.item() == pytest.approx(-0.5)
    assert tok.item() == pytest.approx(-1.25)
    seq.backward()
    # Each token of sample i gets -A_i / len_i / num_sequences.
    expected = torch.tensor([[-1.0 / 2, 0.0, 0.0], [2.0 / 3 / 2] * 3])
    assert torch.allclose(logprobs.grad, expected)


def test_ranks_sharing_a_global_sample_count_sum_to_the_full_batch_loss():
    logprobs, mask, adv = _inputs()
    old = logprobs.detach() - 0.1
    ref = logprobs.detach() + 0.2
    kw = dict(aggregation="sequence", num_sequences=3.0, ref_logprobs=ref, kl_coef=0.05)
    full, _ = policy_loss(logprobs, old, adv, mask, **kw)
    parts = [policy_loss(logprobs[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], ref_logprobs=ref[i : i + 1],
                         aggregation="sequence", num_sequences=3.0, kl_coef=0.05)[0] for i in range(3)]
    assert torch.allclose(full, sum(parts))
    assert not torch.allclose(full, policy_loss(logprobs, old, adv, mask, num_tokens=8.0, ref_logprobs=ref, kl_coef=0.05)[0])


def test_a_sample_without_counted_tokens_adds_nothing_but_still_counts():
    logprobs, mask, adv = _two_lengths()
    empty = torch.cat([mask, torch.zeros(1, 3)])
    lp = torch.cat([logprobs.detach(), torch.full((1, 3), -3.0)])
    loss, _ = policy_loss(lp, lp, torch.cat([adv, torch.tensor([5.0])]), empty, kind="reinforce",
                          aggregation="sequence", num_sequences=3.0)
    assert loss.item() == pytest.approx((1.0 - 2.0) / 3)


def test_bad_kl_and_aggregation_arguments_name_the_field():
    logprobs, mask, adv = _inputs()
    with pytest.raises(ValueError, match=r"aggregation: 'sample' is not one of token, sequence"):
        policy_loss(logprobs, logprobs, adv, mask, num_tokens=8.0, aggregation="sample")
    with pytest.raises(ValueError, match=r"num_sequences: aggregation='sequence' needs"):
        policy_loss(logprobs, logprobs, adv, mask, num_tokens=8.0, aggregation="sequence")
    with pytest.raises(ValueError, match=r"num_tokens: aggregation='token' needs"):
        policy_loss(logprobs, logprobs, adv, mask)
    with pytest.raises(ValueError, match=r"kl_coef: 0.1 > 0 needs ref_logprobs"):
        policy_loss(logprobs, logprobs, adv, mask, num_tokens=8.0, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"kl_coef: -0.1 must be >= 0"):
        policy_loss(logprobs, logprobs, adv, mask, num_tokens=8.0, kl_coef=-0.1, ref_logprobs=logprobs)
    with pytest.raises(AssertionError, match="num_sequences must be > 0"):
        policy_loss(logprobs, logprobs, adv, mask, aggregation="sequence", num_sequences=0)
    with pytest.raises(AssertionError, match="ref_logprobs"):
        policy_loss(logprobs, logprobs, adv, mask, num_tokens=8.0, ref_logprobs=logprobs[:, :2])


def test_the_config_offers_exactly_the_loss_kinds_and_aggregations_implemented_here():
    from elasticrl import config
    from elasticrl.rl import loss

    assert sorted(config.LOSSES) == sorted(loss.LOSS_KINDS)
    assert sorted(config.AGGREGATIONS) == sorted(loss.AGGREGATIONS)


# -- off-policy correction (decoupled objective, truncated importance weights) --------------------


@pytest.mark.parametrize("kind", ["grpo_clip", "reinforce"])
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_with_behaviour_equal_to_proximal_the_weight_is_one_and_the_loss_the_plain_one(kind, aggregation):
    logprobs, mask, adv = _inputs()
    old = logprobs.detach() - 0.1 * torch.rand(3, 4)
    counts = dict(num_tokens=8.0, num_sequences=3.0, kind=kind, aggregation=aggregation)
    plain, _ = policy_loss(logprobs, old, adv, mask, **counts)
    (plain_grad,) = torch.autograd.grad(plain, logprobs)
    decoupled, stats = policy_loss(logprobs, old, adv, mask, proximal_logprobs=old.clone(), tis_cap=2.0, **counts)
    (decoupled_grad,) = torch.autograd.grad(decoupled, logprobs)
    assert torch.equal(plain, decoupled)
    assert torch.equal(plain_grad, decoupled_grad)
    assert stats["tis_weight_mean"] == 1.0 and stats["tis_capped_fraction"] == 0.0


def test_the_ratio_is_taken_against_the_proximal_policy_and_weighted_by_prox_over_behaviour():
    # One token per sample. Behaviour drew it with log p = -1.0; the proximal policy (the trainer
    # before this update) has -0.8: w = e^0.2. The current policy equals the proximal one: ratio 1.
    behaviour = torch.full((2, 1), -1.0)
    prox = torch.full((2, 1), -0.8)
    logprobs = prox.clone().requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    loss, stats = policy_loss(logprobs, behaviour, adv, torch.ones(2, 1), num_tokens=2.0, proximal_logprobs=prox)
    w = math.exp(0.2)
    assert loss.item() == pytest.approx(-(w * 1.0 + w * -1.0) / 2.0)
    loss.backward()
    # d/dlogp of w * ratio * A at ratio 1 is w * A: the REINFORCE gradient scaled by the weight.
    assert torch.allclose(logprobs.grad, torch.tensor([[-w / 2.0], [w / 2.0]]))
    assert stats["clip_fraction"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["tis_weight_mean"] == pytest.approx(w)
    # Against the behaviour logprobs (plain PPO) the same policy would sit at ratio e^0.2 > 1.2: clipped.
    _, plain = policy_loss(logprobs.detach(), behaviour, adv, torch.ones(2, 1), num_tokens=2.0)
    assert plain["clip_fraction"] == 0.5


def test_importance_weights_are_truncated_at_the_cap_and_carry_no_gradient():
    behaviour = torch.tensor([[-5.0, -1.0, -0.5]])  # a token the old policy found very unlikely
    prox = torch.tensor([[-1.0, -1.0, -1.0]])  # weights e^4 (capped), 1, e^-0.5
    logprobs = prox.clone().requires_grad_()
    mask = torch.ones(1, 3)
    loss, stats = policy_loss(logprobs, behaviour, torch.tensor([1.0]), mask, num_tokens=3.0, kind="reinforce",
                              proximal_logprobs=prox, tis_cap=2.0)
    loss.backward()
    weights = torch.tensor([[2.0, 1.0, math.exp(-0.5)]])
    assert torch.allclose(logprobs.grad, -weights / 3.0)
    assert stats["tis_capped_fraction"] == pytest.approx(1 / 3)
    assert stats["tis_weight_mean"] == pytest.approx(weights.mean().item())
    assert all(torch.isfinite(logprobs.grad).ravel())


def test_the_clip_still_bounds_the_step_away_from_the_proximal_policy():
    # The current policy moved e^0.5 away from the proximal one with A > 0: clipped, no gradient,
    # whatever the (capped) weight of the behaviour policy.
    prox = torch.zeros(1, 1)
    logprobs = torch.full((1, 1), 0.5, requires_grad=True)
    loss, stats = policy_loss(logprobs, torch.full((1, 1), -3.0), torch.tensor([1.0]), torch.ones(1, 1), num_tokens=1.0,
                              proximal_logprobs=prox, tis_cap=2.0)
    loss.backward()
    assert logprobs.grad.item() == 0.0 and stats["clip_fraction"] == 1.0
    assert loss.item() == pytest.approx(-2.0 * 1.2)


def test_padding_holds_any_proximal_logprob_without_nan():
    logprobs, mask, adv = _inputs()
    prox = logprobs.detach().clone()
    prox[mask == 0] = 80.0  # exp(80 - old) would overflow a float32 weight if it were not masked first
    loss, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, num_tokens=8.0, proximal_logprobs=prox)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()


def test_a_cap_below_one_is_refused():
    logprobs, mask, adv = _inputs()
    with pytest.raises(ValueError, match="tis_cap: 0.5 must be >= 1"):
        policy_loss(logprobs, logprobs.detach(), adv, mask, num_tokens=8.0, proximal_logprobs=logprobs.detach(), tis_cap=0.5)
