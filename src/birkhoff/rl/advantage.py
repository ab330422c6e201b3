"""Group-normalised advantages (GRPO).

Legend: N prompts, G completions per prompt (group size).

Each prompt is sampled G times; a completion's advantage is its reward relative to its group:
    A = (r - mean_G(r)) / (std_G(r) + eps)          (normalize_std=True, GRPO)
    A =  r - mean_G(r)                              (normalize_std=False, "Dr. GRPO")
std is the population std (ddof 0), so a group of identical rewards gets A = 0 exactly and no
gradient: there is nothing to learn from a group that all succeeded or all failed.
"""

from __future__ import annotations

from torch import Tensor


def group_advantages(
    rewards_NG: Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Advantages [N,G] from rewards [N,G]."""
    if rewards_NG.dim() != 2 or rewards_NG.shape[1] < 2:
        raise ValueError(f"rewards must be [N,G] with G >= 2, got shape {tuple(rewards_NG.shape)}")
    centered_NG = rewards_NG - rewards_NG.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centered_NG
    return centered_NG / (rewards_NG.std(dim=1, correction=0, keepdim=True) + eps)
