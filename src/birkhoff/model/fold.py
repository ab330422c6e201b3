"""GEMM-folded mHC sublayers: the stream mixes inside the projections around attention and MLP.

Legend: B batch, T tokens, S streams, D model dim, Z a folded projection's other side.

The unfused sublayer (hyper.hyper_connection) mixes the streams into y, writes it, normalises it
(another write) and projects; F's output projection writes F, which mix out reads back. Here the
coefficients come from the fused coefficient op alone, `mix_norm_linear` projects
RMSNorm(sum_s H_pre[s] x_s) with the streams read in the GEMM's loads (q, k, v or gate and up as
one weight), and `linear_mix_out` writes the new streams from the output (or down) projection's
epilogue. Same parameters, same math; numerics differ from the unfused path by one bf16 rounding
of y and of F (kept in fp32 here), so the fold is a switch of its own (`Block.fold`, set by
`block.apply_fold`, `TrainConfig.fold_gemms`), taken where the fused ops run (`hyper.fused_ops`)
on a dense SwiGLU or an attention without an output bias; elsewhere the unfused path runs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from birkhoff.kernels import mhc
from birkhoff.model.hyper import HyperConnection, fused_ops
from birkhoff.model.layers import Attention, RMSNorm, SwiGLU, swiglu


def folds(hc: nn.Module, x_BTSD: Tensor) -> bool:
    """Whether the sublayer behind `hc` can run folded: an mHC wrapper on the fused ops."""
    return isinstance(hc, HyperConnection) and fused_ops(x_BTSD, hc.kernels) is not None


def _coefficients(hc: HyperConnection, x_BTSD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return mhc.mhc_coefficients(
        x_BTSD, hc.phi, hc.alpha, hc.bias, iters=hc.iters, norm_eps=hc.norm_eps, eps=hc.eps
    )


def _compute_dtype(x_BTSD: Tensor, weight: Tensor) -> torch.dtype:
    """The GEMMs' operand dtype: autocast's where it is on, else the weight's."""
    device = x_BTSD.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def attention_sublayer(
    hc: nn.Module, norm: RMSNorm, attn: Attention, x_BTSD: Tensor, rope: tuple[Tensor, Tensor]
) -> Tensor:
    """The attention sublayer with its mixes folded into the QKV and output projections."""
    assert isinstance(hc, HyperConnection), "check attention_folds first"
    pre, post, res = _coefficients(hc, x_BTSD)
    dtype = _compute_dtype(x_BTSD, attn.wq.weight)
    w_ZD = torch.cat((attn.wq.weight, attn.wk.weight, attn.wv.weight)).to(dtype)
    qkv_BTZ = mhc.mix_norm_linear(x_BTSD, pre, norm.weight, w_ZD, eps=norm.eps)
    if attn.wq.bias is not None:
        qkv_BTZ = qkv_BTZ + torch.cat((attn.wq.bias, attn.wk.bias, attn.wv.bias)).to(dtype)
    sizes = (attn.wq.out_features, attn.wk.out_features, attn.wv.out_features)
    q, k, v = qkv_BTZ.split(sizes, dim=-1)
    heads_BTZ = attn.heads(q, k, v, rope)
    return mhc.linear_mix_out(heads_BTZ, attn.wo.weight.to(dtype), x_BTSD, post, res)


def mlp_sublayer(hc: nn.Module, norm: RMSNorm, mlp: nn.Module, x_BTSD: Tensor) -> Tensor:
    """The SwiGLU sublayer with its mixes folded into the gate/up and down projections."""
    assert isinstance(hc, HyperConnection) and type(mlp) is SwiGLU, "check mlp_folds first"
    pre, post, res = _coefficients(hc, x_BTSD)
    dtype = _compute_dtype(x_BTSD, mlp.w_gate.weight)
    w_ZD = torch.cat((mlp.w_gate.weight, mlp.w_up.weight)).to(dtype)
    gate_up_BTZ = mhc.mix_norm_linear(x_BTSD, pre, norm.weight, w_ZD, eps=norm.eps)
    act_BTZ = swiglu(*gate_up_BTZ.chunk(2, dim=-1))
    return mhc.linear_mix_out(act_BTZ, mlp.w_down.weight.to(dtype), x_BTSD, post, res)


def attention_folds(hc: nn.Module, attn: nn.Module, x_BTSD: Tensor) -> bool:
    """Exactly `Attention` (a subclass may compute otherwise), without an output bias."""
    return folds(hc, x_BTSD) and type(attn) is Attention and attn.wo.bias is None


def mlp_folds(hc: nn.Module, mlp: nn.Module, x_BTSD: Tensor) -> bool:
    """Exactly the dense `SwiGLU` (MoE layers and variants run unfolded)."""
    return folds(hc, x_BTSD) and type(mlp) is SwiGLU
