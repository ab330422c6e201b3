"""Group-normalised advantages (GRPO).

Legend: Q prompts, W completions per prompt (group size).

Each prompt is sampled W times; a completion's advantage is its reward relative to its group:
    A = (r - mean_G(r)) / (std_G(r) + eps)          (normalize_std=True, GRPO)
    A =  r - mean_G(r)                              (normalize_std=False, "Dr. GRPO")
std is the population std (ddof 0), so a group of identical rewards gets A = 0 exactly and no
gradient: there is nothing to learn from a group that all succeeded or all failed.
"""

from __future__ import annotations

from torch import Tensor


def group_advantages(
    rewards_QW: Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Advantages [Q,W] from rewards [Q,W]."""
    if rewards_QW.dim() != 2 or rewards_QW.shape[1] < 2:
        raise ValueError(f"rewards must be [Q,W] with W >= 2, got shape {tuple(rewards_QW.shape)}")
    centered_QW = rewards_QW - rewards_QW.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centered_QW
    return centered_QW / (rewards_QW.std(dim=1, correction=0, keepdim=True) + eps)
