"""One transformer block on the stream axis: mHC around attention and around the MLP.

Legend: B batch, T tokens, S streams, D model dim.

Each sublayer is pre-norm (RMSNorm then F) and wrapped by its own hyper-connection, whose home
stream rotates with the sublayer index so different streams start as different sublayers' inputs.
"""

from __future__ import annotations

from torch import Tensor, nn

from birkhoff.config import ModelConfig
from birkhoff.model.hyper import build_hyper_connection
from birkhoff.model.layers import Attention, RMSNorm
from birkhoff.model.moe import RoutedFeedForward, build_feed_forward


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.hc_attn = build_hyper_connection(cfg, home=2 * index)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = build_feed_forward(cfg, index)  # SwiGLU, or MoE when cfg.moe says so
        self.hc_mlp = build_hyper_connection(cfg, home=2 * index + 1)

    def forward(
        self, x_BTSD: Tensor, rope: tuple[Tensor, Tensor], input_ids_BT: Tensor | None = None
    ) -> Tensor:
        """`input_ids_BT`: the token ids, which a hash-routed MoE layer routes by."""
        x_BTSD = self.hc_attn(x_BTSD, lambda h_BTD: self.attn(self.attn_norm(h_BTD), rope))
        return self.hc_mlp(x_BTSD, lambda h_BTD: self.feed_forward(h_BTD, input_ids_BT))

    def feed_forward(self, h_BTD: Tensor, input_ids_BT: Tensor | None) -> Tensor:
        if isinstance(self.mlp, RoutedFeedForward):
            return self.mlp(self.mlp_norm(h_BTD), input_ids_BT)
        return self.mlp(self.mlp_norm(h_BTD))
