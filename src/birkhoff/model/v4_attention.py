"""DeepSeek-V4 attention (training / prefill path: a full causal sequence); docs/v4.md.

Legend: B batch, T tokens, N key positions, D model dim, H query heads, K head dim, Y compressed
entries, O query low rank, K2 rope pairs (qk_rope_head_dim / 2).

Low-rank queries (q_a_proj -> RMSNorm -> q_b_proj -> per-head RMSNorm without weight); one
key/value head read as both key and value; partial interleaved rope on the trailing
qk_rope_head_dim channels, rotated back on the output (the value was roped too); a learned sink
logit per head; a grouped low-rank output projection (o_a_proj per head group, o_b_proj to D).
Keys: the sliding window, plus in CSA / HCA layers their compressor's entries
(model/v4_compressor.py) under the "compress" rope base. Parameter names are transformers'
(`DeepseekV4Attention`). Left out: decode caches (the engine's), attention dropout."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from birkhoff.config import ModelConfig, V4AttentionConfig
from birkhoff.model.layers import ROPE_SCALING_FNS, RMSNorm, rms_norm
from birkhoff.model.v4_compressor import Compressor, apply_partial_rope, build_compressor


class V4Rope(NamedTuple):
    """cos, sin [B,T,K2] (fp64) of the two rope bases: sliding layers use `main`, CSA and HCA
    layers and their compressors `compress`."""

    main: tuple[Tensor, Tensor]
    compress: tuple[Tensor, Tensor]


def v4_inv_freq(rope_dim: int, theta: float, device: torch.device | None = None) -> Tensor:
    """1 / theta^(2i / rope_dim) for i < rope_dim / 2, fp64 (transformers' default rope)."""
    return 1.0 / (
        theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64, device=device) / rope_dim)
    )


def v4_rope(positions_BT: Tensor, cfg: ModelConfig) -> V4Rope:
    """The rope tables of a V4 model at `positions_BT`; a yarn scaling in cfg applies to the
    compress base only, as V4 does (its mscale is not applied: V4 pins it to 1)."""
    v4 = cfg.attention
    assert v4 is not None
    angles_BT1 = positions_BT.to(torch.float64)[..., None]
    main_K2 = v4_inv_freq(v4.qk_rope_head_dim, cfg.rope_theta, positions_BT.device)
    compress_K2 = v4_inv_freq(v4.qk_rope_head_dim, v4.compress_rope_theta, positions_BT.device)
    if cfg.rope_scaling != "none":
        compress_cfg = cfg.replace(rope_theta=v4.compress_rope_theta)
        compress_K2 = ROPE_SCALING_FNS[cfg.rope_scaling](compress_K2, compress_cfg)
    main, compress = angles_BT1 * main_K2, angles_BT1 * compress_K2
    return V4Rope((main.cos(), main.sin()), (compress.cos(), compress.sin()))


def sliding_window_mask(T: int, window: int, device: torch.device) -> Tensor:
    """[T,T] bool: query t reads keys t - window < n <= t."""
    t_T1 = torch.arange(T, device=device)[:, None]
    n_1T = torch.arange(T, device=device)[None, :]
    return (n_1T <= t_T1) & (n_1T > t_T1 - window)


def sink_attention(
    q_BHTK: Tensor, kv_BNK: Tensor, allowed_BTN: Tensor, sinks_H: Tensor, scale: float
) -> Tensor:
    """Softmax attention of every head over the one shared key/value head, with a sink logit
    per head (a softmax column whose probability is dropped) -> [B,T,H,K].

    Written as transformers' eager V4 attention computes it (the kv head repeated per query
    head once as key and once as value, the row max subtracted before the softmax), so fp64
    values and gradients agree to the last bit.
    """
    B, H, T, K = q_BHTK.shape
    N = kv_BNK.shape[1]
    k_BHNK = kv_BNK[:, None].expand(B, H, N, K).reshape(B, H, N, K)
    v_BHNK = kv_BNK[:, None].expand(B, H, N, K).reshape(B, H, N, K)
    logits_BHTN = torch.matmul(q_BHTK, k_BHNK.transpose(2, 3)) * scale
    logits_BHTN = logits_BHTN.masked_fill(~allowed_BTN[:, None], float("-inf"))
    sinks_BHT1 = sinks_H.reshape(1, -1, 1, 1).expand(B, -1, T, -1)
    combined = torch.cat([logits_BHTN, sinks_BHT1], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs_BHTN = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    out_BHTK = torch.matmul(probs_BHTN.to(v_BHNK.dtype), v_BHNK)
    return out_BHTK.transpose(1, 2)


class GroupedLinear(nn.Linear):
    """V4's o_a_proj: heads split into `groups` groups, each projected by its own block
    (weight [groups * rank, H*K / groups], the blocks stacked) -> [.., groups * rank]."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x_BTHK: Tensor) -> Tensor:
        return grouped_linear(x_BTHK, self.weight, self.groups)


def grouped_linear(x_BTHK: Tensor, weight: Tensor, groups: int) -> Tensor:
    """Per-group projection of the heads' outputs [B,T,H,K] -> [B,T, groups * rank]."""
    B, T = x_BTHK.shape[:2]
    x = x_BTHK.reshape(B * T, groups, -1).transpose(0, 1)  # [groups, B*T, H*K/groups]
    w = weight.view(groups, -1, x.shape[-1]).transpose(1, 2)  # [groups, H*K/groups, rank]
    return torch.bmm(x, w).transpose(0, 1).reshape(B, T, -1)


class V4Attention(nn.Module):
    """One V4 attention layer of kind sliding, CSA or HCA (`V4AttentionConfig.layer_types`)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        v4 = cfg.attention
        assert isinstance(v4, V4AttentionConfig)
        H, K, groups = cfg.num_heads, v4.head_dim, v4.o_groups
        self.layer_type = v4.layer_type(index)
        self.num_heads, self.head_dim, self.window, self.eps = H, K, v4.sliding_window, cfg.norm_eps
        self.q_a_proj = nn.Linear(cfg.dim, v4.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(v4.q_lora_rank, cfg.norm_eps)
        self.q_b_proj = nn.Linear(v4.q_lora_rank, H * K, bias=False)
        self.kv_proj = nn.Linear(cfg.dim, K, bias=False)
        self.kv_norm = RMSNorm(K, cfg.norm_eps)
        self.o_a_proj = GroupedLinear(H * K // groups, groups * v4.o_lora_rank, groups)
        self.o_b_proj = nn.Linear(groups * v4.o_lora_rank, cfg.dim, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H))
        self.compressor: Compressor | None = build_compressor(cfg, self.layer_type)

    def forward(self, x_BTD: Tensor, rope: V4Rope) -> Tensor:
        B, T, _ = x_BTD.shape
        tables = rope.main if self.compressor is None else rope.compress
        q_res_BTO = self.q_a_norm(self.q_a_proj(x_BTD))
        q_BHTK = self.q_b_proj(q_res_BTO).view(B, T, self.num_heads, -1).transpose(1, 2)
        q_BHTK = apply_partial_rope(rms_norm(q_BHTK, None, self.eps), *tables)
        kv_B1TK = self.kv_norm(self.kv_proj(x_BTD)).view(B, T, 1, -1).transpose(1, 2)
        kv_BNK = apply_partial_rope(kv_B1TK, *tables)[:, 0]
        allowed_BTN = sliding_window_mask(T, self.window, x_BTD.device).expand(B, T, T)
        if self.compressor is not None:
            entries_BYK, reads_BTY = self.compressor(x_BTD, q_res_BTO, rope.compress)
            kv_BNK = torch.cat([kv_BNK, entries_BYK], dim=1)
            reads_BTY = reads_BTY.expand(B, T, entries_BYK.shape[1])
            allowed_BTN = torch.cat([allowed_BTN, reads_BTY], dim=-1)
        out_BTHK = sink_attention(q_BHTK, kv_BNK, allowed_BTN, self.sinks, self.head_dim**-0.5)
        cos, sin = tables
        out_BTHK = apply_partial_rope(out_BTHK.transpose(1, 2), cos, -sin).transpose(1, 2)
        return self.o_b_proj(self.o_a_proj(out_BTHK))
