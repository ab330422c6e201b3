"""One transformer block on the stream axis: mHC around attention and around the MLP.

Legend: B batch, T tokens, S streams, D model dim.

Each sublayer is pre-norm (RMSNorm then F) and wrapped by its own hyper-connection, whose home
stream rotates with the sublayer index so different streams start as different sublayers' inputs.
The attention is the config's model type: grouped-query attention (Llama family), or
DeepSeek-V4's (`ModelConfig.attention`, model/v4_attention.py), which takes `V4Rope` tables.
"""

from __future__ import annotations

from torch import Tensor, nn

from birkhoff.config import ModelConfig
from birkhoff.model.hyper import build_hyper_connection
from birkhoff.model.layers import Attention, RMSNorm
from birkhoff.model.moe import build_feed_forward
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
        # a feed-forward whose routing reads the token ids (V4's hash-routed MoE layers) sets
        # `takes_token_ids`; it is then called as mlp(x_BTD, input_ids_BT)
        self.mlp_takes_ids = bool(getattr(self.mlp, "takes_token_ids", False))

    def forward(
        self, x_BTSD: Tensor, rope: RopeTables, input_ids_BT: Tensor | None = None
    ) -> Tensor:
        x_BTSD = self.hc_attn(x_BTSD, lambda h_BTD: self.attn(self.attn_norm(h_BTD), rope))
        return self.hc_mlp(x_BTSD, lambda h_BTD: self.feed_forward(h_BTD, input_ids_BT))

    def feed_forward(self, h_BTD: Tensor, input_ids_BT: Tensor | None) -> Tensor:
        if self.mlp_takes_ids:
            if input_ids_BT is None:
                raise ValueError("this block's feed-forward routes by token id: pass input_ids")
            return self.mlp(self.mlp_norm(h_BTD), input_ids_BT)
        return self.mlp(self.mlp_norm(h_BTD))
