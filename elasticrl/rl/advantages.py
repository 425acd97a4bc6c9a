"""Group-normalized advantages (GRPO): each sample is scored against the other samples of its prompt."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of ``rewards`` laid out group after group.

    rewards: [num_groups * group_size], the samples of one prompt contiguous.
    Returns the same shape: ``r - mean(group)``, divided by ``std(group) + eps`` when ``scale``.
    A group whose samples all scored the same gets zero advantage (it carries no signal), never NaN.
    """
    assert rewards.dim() == 1, f"rewards must be 1-D, got shape {tuple(rewards.shape)}"
    assert group_size >= 1 and rewards.numel() % group_size == 0, (
        f"{rewards.numel()} rewards do not split into groups of {group_size}"
    )
    groups = rewards.float().view(-1, group_size)  # [G, S]
    centered = groups - groups.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centered = centered / (groups.std(dim=1, keepdim=True, unbiased=False) + eps)
    return centered.reshape(-1)
