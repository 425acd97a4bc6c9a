"""Group-relative advantages: each sample is scored against the other samples of its prompt.

Every estimator here sees the rewards of one iteration laid out group after group (the
``group_size`` samples of one prompt contiguous) and returns one advantage per sample. None needs a
value network: the group itself is the baseline, which is what makes GRPO-style training cheap.

``ADVANTAGES`` maps a config name to its function; ``compute_advantages`` looks it up. To add a
variant (REINFORCE++'s batch-normalised baseline, a PPO-style estimator fed with extra inputs, ...)
write a function ``(rewards [N], group_size) -> advantages [N]`` on top of ``_groups``, document
where it comes from, and register it below; an unknown name lists the registered ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AdvantageFn = Callable[[torch.Tensor, int], torch.Tensor]
"""``fn(rewards [num_groups * group_size], group_size) -> advantages [num_groups * group_size]``."""


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``rewards`` [G * S] as float [G, S], after checking that it splits into groups."""
    assert rewards.dim() == 1, f"rewards must be 1-D, got shape {tuple(rewards.shape)}"
    assert group_size >= 1 and rewards.numel() % group_size == 0, (
        f"{rewards.numel()} rewards do not split into groups of {group_size}"
    )
    return rewards.float().view(-1, group_size)


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of ``rewards`` laid out group after group.

    rewards: [num_groups * group_size], the samples of one prompt contiguous.
    Returns the same shape: ``r - mean(group)``, divided by ``std(group) + eps`` when ``scale``.
    A group whose samples all scored the same gets zero advantage (it carries no signal), never NaN.
    """
    groups = _groups(rewards, group_size)  # [G, S]
    centered = groups - groups.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centered = centered / (groups.std(dim=1, keepdim=True, unbiased=False) + eps)
    # Exactly zero where every sample scored the same: the float32 mean of equal values can be one
    # ulp off (7 x 2/3), and the division above made that rounding an O(0.1) advantage.
    flat = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return centered.masked_fill(flat, 0.0).reshape(-1)


def grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``(r - mean) / (std + eps)`` per group.

    The std scaling makes every prompt's advantages unit-sized whatever its reward spread, which
    up-weights prompts that are nearly always (or never) solved.
    """
    return group_advantages(rewards, group_size, scale=True)


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``r - mean`` per group.

    Drops GRPO's division by the group std, the difficulty bias that over-weights prompts whose
    samples nearly all agree; advantages keep the reward's own scale.
    """
    return group_advantages(rewards, group_size, scale=False)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): ``r_i - mean(r_j for j != i)`` within the group.

    The leave-one-out baseline does not depend on the sample it scores, so the estimate stays
    unbiased; it equals ``S / (S - 1) * (r_i - mean)``. A group of one has no other sample to
    compare with: its advantage is 0.
    """
    groups = _groups(rewards, group_size)  # [G, S]
    if group_size == 1:
        return torch.zeros_like(groups).reshape(-1)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others_mean).reshape(-1)


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def compute_advantages(name: str, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Advantages of ``rewards`` (group after group) by the estimator registered as ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid names).
        AssertionError: ``rewards`` is not 1-D or does not split into groups of ``group_size``.
    """
    fn = ADVANTAGES.get(name)
    if fn is None:
        raise ValueError(f"advantage estimator {name!r} is not registered; choose one of {', '.join(sorted(ADVANTAGES))}")
    return fn(rewards, group_size)
