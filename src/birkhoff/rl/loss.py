"""GRPO policy loss: token-level clipped importance ratio against the rollout logprobs.

Legend: B completions, T completion tokens.

    ratio_t = exp(logp_t - logp_rollout_t)
    loss    = -sum_t mask_t min(ratio_t A, clip(ratio_t, 1-eps_low, 1+eps_high) A) / sum_t mask_t
          (+ beta * KL_t to a frozen reference, the k3 estimator exp(d) - d - 1, d = ref - logp)
The mean is over all completion tokens of the (global) batch, so every token weighs the same
and the ranks' losses sum to the single-process loss. `logp_rollout` comes from the engine that
sampled the tokens, so the ratio also corrects engine/trainer mismatch and bounded staleness;
`logp` comes from the chunked `token_logprobs`, never from [B,T,V] logits. See docs/grpo.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from birkhoff.config import check


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOLossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_weight: float = 0.0  # beta; 0 = no reference model

    def __post_init__(self) -> None:
        check(0 <= self.clip_low < 1, "clip_low", self.clip_low, "must be in [0, 1)")
        check(self.clip_high >= 0, "clip_high", self.clip_high, "must be >= 0")
        check(self.kl_weight >= 0, "kl_weight", self.kl_weight, "must be >= 0")


def grpo_loss(
    logp_BT: Tensor,
    rollout_logp_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    cfg: GRPOLossConfig,
    ref_logp_BT: Tensor | None = None,
    *,
    num_tokens: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss and detached metrics (clip fraction, mean ratio, KL).

    `num_tokens`: the loss's normaliser (default: the masked tokens of this batch).
    """
    mask = mask_BT.to(logp_BT.dtype)
    count = mask.sum().clamp(min=1.0)
    loss_count = count if num_tokens is None else num_tokens.to(mask.dtype).clamp(min=1.0)
    ratio_BT = torch.exp(logp_BT - rollout_logp_BT)
    adv_BT = advantages_B.to(logp_BT.dtype)[:, None]
    clipped_BT = ratio_BT.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surrogate_BT = torch.minimum(ratio_BT * adv_BT, clipped_BT * adv_BT)
    loss = -(surrogate_BT * mask).sum() / loss_count
    kl = torch.zeros((), dtype=logp_BT.dtype, device=logp_BT.device)
    if ref_logp_BT is not None:
        d_BT = ref_logp_BT - logp_BT
        kl_sum = ((torch.exp(d_BT) - d_BT - 1.0) * mask).sum()
        kl = kl_sum / count
        loss = loss + cfg.kl_weight * (kl_sum / loss_count)
    with torch.no_grad():
        was_clipped = (ratio_BT != clipped_BT).to(mask.dtype)
        metrics = {
            "clip_frac": float((was_clipped * mask).sum() / count),
            "ratio_mean": float((ratio_BT * mask).sum() / count),
            "kl_ref": float(kl),
        }
    return loss, metrics
