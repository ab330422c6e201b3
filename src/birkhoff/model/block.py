"""One transformer block on the stream axis: mHC around attention and around the MLP.

Legend: B batch, T tokens, S streams, D model dim.

Each sublayer is pre-norm (RMSNorm then F) and wrapped by its own hyper-connection, whose home
stream rotates with the sublayer index so different streams start as different sublayers' inputs.
The attention is the config's model type: grouped-query attention (Llama family), or
DeepSeek-V4's (`ModelConfig.attention`, model/v4_attention.py), which takes `V4Rope` tables.
`Block.fold` (set by `apply_fold`) runs a sublayer with its stream mixes folded into the
projections around it where it can (model/fold.py); the unfused path is the reference.
"""

from __future__ import annotations

from typing import TypeVar

from torch import Tensor, nn

from birkhoff.config import ModelConfig
from birkhoff.model import fold
from birkhoff.model.hyper import build_hyper_connection
from birkhoff.model.layers import Attention, RMSNorm
from birkhoff.model.moe import RoutedFeedForward, build_feed_forward
from birkhoff.model.v4_attention import V4Attention, V4Rope

RopeTables = tuple[Tensor, Tensor] | V4Rope  # what the block's attention takes


def build_attention(cfg: ModelConfig, index: int) -> nn.Module:
    """The attention of block `index`: grouped-query, or V4's of the layer's kind."""
    if cfg.attention is not None:
        return V4Attention(cfg, index)
    return Attention(cfg)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = build_attention(cfg, index)
        self.hc_attn = build_hyper_connection(cfg, home=2 * index)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = build_feed_forward(cfg, index)  # SwiGLU, or MoE when cfg.moe says so
        self.hc_mlp = build_hyper_connection(cfg, home=2 * index + 1)
        self.fold = False  # mixes folded into the projections (`apply_fold`)

    def forward(
        self, x_BTSD: Tensor, rope: RopeTables, input_ids_BT: Tensor | None = None
    ) -> Tensor:
        """`input_ids_BT`: the token ids, which a hash-routed MoE layer routes by."""
        attn = self.attn
        if (
            self.fold
            and isinstance(attn, Attention)
            and not isinstance(rope, V4Rope)
            and fold.attention_folds(self.hc_attn, attn, x_BTSD)
        ):
            x_BTSD = fold.attention_sublayer(self.hc_attn, self.attn_norm, attn, x_BTSD, rope)
        else:
            x_BTSD = self.hc_attn(x_BTSD, lambda h_BTD: self.attn(self.attn_norm(h_BTD), rope))
        if self.fold and fold.mlp_folds(self.hc_mlp, self.mlp, x_BTSD):
            return fold.mlp_sublayer(self.hc_mlp, self.mlp_norm, self.mlp, x_BTSD)
        return self.hc_mlp(x_BTSD, lambda h_BTD: self.feed_forward(h_BTD, input_ids_BT))

    def feed_forward(self, h_BTD: Tensor, input_ids_BT: Tensor | None) -> Tensor:
        if isinstance(self.mlp, RoutedFeedForward):
            return self.mlp(self.mlp_norm(h_BTD), input_ids_BT)
        return self.mlp(self.mlp_norm(h_BTD))


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def apply_fold(model: ModuleT, on: bool) -> ModuleT:
    """Fold (or unfold) every block's stream mixes into its projections where the fused mHC
    ops run (model/fold.py): a runtime choice applied from outside, as `apply_kernels`."""
    if not isinstance(on, bool):
        raise ValueError(f"fold={on!r} is invalid: must be a bool")
    for module in model.modules():
        if isinstance(module, Block):
            module.fold = on
    return model
