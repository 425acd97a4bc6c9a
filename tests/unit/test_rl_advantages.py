"""group_advantages: per-group centering and scaling, degenerate groups, shape checks."""

from __future__ import annotations

import pytest
import torch

from elasticrl.rl.advantages import group_advantages


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
