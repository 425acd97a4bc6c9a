"""Advantage estimators: per-group centering and scaling, RLOO, Dr. GRPO, the registry, shape checks."""

from __future__ import annotations

import pytest
import torch

from elasticrl.rl.advantages import ADVANTAGES, compute_advantages, group_advantages


def test_each_group_is_centered_and_scaled_on_its_own():
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0, 10.0, 30.0, 10.0, 30.0])
    adv = group_advantages(rewards, 4).view(2, 4)
    assert torch.allclose(adv.mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(adv.std(dim=1, unbiased=False), torch.ones(2), atol=1e-4)
    # Scale-free: the second group's rewards are 20x apart, its advantages are not.
    assert torch.allclose(adv[0], adv[1], atol=1e-4)


def test_unscaled_advantages_are_reward_minus_group_mean():
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), 2, scale=False)
    assert adv.tolist() == [-0.5, 0.5, -1.5, 1.5]


def test_a_group_with_equal_rewards_carries_no_signal_and_no_nan():
    adv = group_advantages(torch.tensor([0.5, 0.5, 0.5, 0.0, 1.0, 0.5]), 3)
    assert torch.isfinite(adv).all()
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[4] > 0 > adv[3]


def test_rewards_that_do_not_split_into_groups_are_refused():
    with pytest.raises(AssertionError, match="do not split into groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(AssertionError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4)


# --- the registry: grpo, dr_grpo, rloo --------------------------------------------------------


def test_rloo_subtracts_the_mean_of_the_other_samples():
    adv = compute_advantages("rloo", torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    # Sample 0: 1 - mean(0, 0, 1) = 2/3; sample 1: 0 - mean(1, 0, 1) = -2/3.
    assert torch.allclose(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_rloo_works_group_by_group_and_a_group_of_one_gets_zero():
    adv = compute_advantages("rloo", torch.tensor([3.0, 0.0, 6.0, 2.0, 2.0, 5.0]), 3)
    # Group 0: 3 - (0+6)/2 = 0, 0 - (3+6)/2 = -4.5, 6 - (3+0)/2 = 4.5. Group 1: 2 - 3.5 twice, 5 - 2.
    assert adv.tolist() == [0.0, -4.5, 4.5, -1.5, -1.5, 3.0]
    assert compute_advantages("rloo", torch.tensor([0.3, 1.0]), 1).tolist() == [0.0, 0.0]


def test_dr_grpo_centres_without_scaling():
    adv = compute_advantages("dr_grpo", torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 4.0]), 4)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, -1.0, -1.0, -1.0, 3.0]


def test_grpo_by_name_is_the_default_group_advantages():
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.2, 0.9])
    adv = compute_advantages("grpo", rewards, 3)
    assert torch.equal(adv, group_advantages(rewards, 3))
    # Group 0: mean 2/3, population std sqrt(2)/3: (0 - 2/3) / (sqrt(2)/3) = -sqrt(2).
    assert adv[0].item() == pytest.approx(-(2**0.5), rel=1e-5)
    assert adv[1].item() == pytest.approx(2**0.5 / 2, rel=1e-5)


def test_every_registered_estimator_gives_finite_zeros_on_a_flat_group():
    for name in ADVANTAGES:
        adv = compute_advantages(name, torch.full((4,), 0.7), 4)
        assert torch.isfinite(adv).all() and adv.abs().max() < 1e-6, name


def test_an_unknown_estimator_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"'ppo' is not registered; choose one of dr_grpo, grpo, rloo"):
        compute_advantages("ppo", torch.zeros(4), 2)


def test_registered_estimators_check_the_group_layout():
    with pytest.raises(AssertionError, match="do not split into groups of 4"):
        compute_advantages("rloo", torch.zeros(6), 4)
    with pytest.raises(AssertionError, match="1-D"):
        compute_advantages("dr_grpo", torch.zeros(2, 4), 4)


def test_the_config_offers_exactly_the_registered_estimators():
    from elasticrl import config

    assert sorted(config.ADVANTAGES) == sorted(ADVANTAGES)
