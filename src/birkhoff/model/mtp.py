"""Multi-token prediction (DeepSeek-V3 style) on the stream axis, and its loss.

Legend: B batch, T tokens, S streams, D model dim, V vocab, M MTP depth.

Depth k = 1..M at position i predicts token t_{i+k+1} from
    h'_k = W_k [RMSNorm(h_{k-1}); RMSNorm(Emb(t_{i+k}))]   (per stream, W_k: D x 2D)
    h_k  = Block_k(h'_k)                                     (one mHC block)
    logits = lm_head(Norm_k(Contract_k(h_k)))                (own contraction + norm, shared head)
with h_0 the decoder's multistream output [B,T,S,D] (a contracted input is a ValueError).
`labels` are the input ids and the shift happens here (main head 1, depth k k+1), targets and
mask rolled together; the loss is a per-token mean (0 for an all-masked batch). See docs/mhc.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from birkhoff.config import ModelConfig
from birkhoff.model.block import Block, RopeTables
from birkhoff.model.hyper import build_contraction
from birkhoff.model.layers import RMSNorm, rms_norm
from birkhoff.model.logprobs import token_logprobs


def shift_targets(labels_BT: Tensor, mask_BT: Tensor, shift: int) -> tuple[Tensor, Tensor]:
    """targets[i] = labels[i+shift], mask[i] = mask[i+shift]; the last `shift` positions masked."""
    T = labels_BT.shape[1]
    targets_BT = torch.roll(labels_BT, -shift, dims=1)
    shifted_BT = torch.roll(mask_BT, -shift, dims=1).clone()
    shifted_BT[:, max(T - shift, 0) :] = False
    return targets_BT, shifted_BT


def masked_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of x over masked-in positions (0 when nothing is in: the count is clamped to 1)."""
    mask = mask_BT.to(x_BT.dtype)
    return (x_BT * mask).sum() / mask.sum().clamp(min=1.0)


def masked_token_ce(
    hidden_BTD: Tensor, weight_VD: Tensor, targets_BT: Tensor, mask_BT: Tensor
) -> Tensor:
    """Mean cross-entropy of the head `weight_VD` over masked-in tokens (>= fp32, chunked:
    `token_logprobs`; 0 when nothing is in)."""
    return masked_mean(-token_logprobs(hidden_BTD, weight_VD, targets_BT).logp, mask_BT)


def combine_losses(main: Tensor, mtp_losses: list[Tensor], weight: float) -> Tensor:
    """L = L_main + (lambda / M) * sum_k L_k."""
    if not mtp_losses:
        return main
    return main + (weight / len(mtp_losses)) * torch.stack(mtp_losses).sum()


class MTPDepth(nn.Module):
    """One MTP depth: merge the previous depth's streams with the next token's embedding."""

    def __init__(self, cfg: ModelConfig, depth: int) -> None:
        super().__init__()
        self.num_streams = cfg.num_streams
        self.hidden_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.embed_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg, index=cfg.num_layers + depth)
        self.contraction = build_contraction(cfg)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def check_streams(self, h: Tensor) -> None:
        S = self.num_streams
        if h.dim() != 4 or h.shape[2] != S:
            raise ValueError(
                f"MTP expects the decoder's multistream tensor [B,T,S={S},D]; got shape "
                f"{tuple(h.shape)} (a contracted [B,T,D] hidden state loses the stream axis)"
            )

    def merge(self, h_BTSD: Tensor, emb_BTD: Tensor) -> Tensor:
        """h'_k: per stream, W_k [RMSNorm(h); RMSNorm(emb)] -> [B,T,S,D]."""
        self.check_streams(h_BTSD)
        return mtp_merge(
            h_BTSD,
            emb_BTD,
            self.hidden_norm.weight,
            self.embed_norm.weight,
            eps=self.hidden_norm.eps,
            project=self.proj,
        )

    def forward(self, h_BTSD: Tensor, emb_BTD: Tensor, rope: RopeTables) -> Tensor:
        """h_k = Block_k(h'_k): the merge, then the depth's mHC block, as one recompute unit."""
        return self.block(self.merge(h_BTSD, emb_BTD), rope)

    def head_input(self, h_BTSD: Tensor) -> Tensor:
        """Own contraction + norm: the input of the shared lm_head, [B,T,D]."""
        return self.norm(self.contraction(h_BTSD))


def mtp_merge(
    h_BTSD: Tensor,
    emb_BTD: Tensor,
    hidden_norm_D: Tensor,
    embed_norm_D: Tensor,
    *,
    eps: float,
    project: Callable[[Tensor], Tensor],
    kernels: str = "eager",
) -> Tensor:
    """h'_k = W_k [RMSNorm(h_{k-1}); RMSNorm(emb)] on every stream -> [B,T,S,D].

    `project` applies W_k ([D, 2D]) to the concatenation [B,T,S,2D]; the trainer passes its
    nn.Linear, the engine its (possibly fp8) matmul, so both run this one function. `kernels`
    (the engine's kernel choice) selects the fused inference RMSNorm for the two norms.
    """
    e_BTD = rms_norm(emb_BTD, embed_norm_D, eps, kernels=kernels)
    h_BTSD = rms_norm(h_BTSD, hidden_norm_D, eps, kernels=kernels)
    return project(torch.cat((h_BTSD, e_BTD[:, :, None, :].expand_as(h_BTSD)), dim=-1))
