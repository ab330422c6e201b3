"""GEMM-folded mHC sublayers: the stream mixes in the passes next to attention's and MLP's GEMMs.

Legend: B batch, T tokens, S streams, D model dim, Z a folded projection's other side.

The unfused sublayer (hyper.hyper_connection) mixes the streams into y and writes it; its RMSNorm
reads y and writes the projection's input. Here one autograd node (`mhc.fold_entry`) runs the
coefficient op and one row pass that mixes, normalises and writes the projection's input once,
in the GEMMs' dtype; torch's GEMMs project (q, k, v or gate and up as one weight); the fused mix
out reads the x the entry hands back, so the entry's backward writes x's gradient once for the
coefficients, the norm and mix out. Same parameters, same math; y stays fp32 (the unfused path
rounds it once), so the fold is a switch of its own (`Block.fold`, set by `block.apply_fold`,
`TrainConfig.fold_gemms`), taken where the fused ops run (`hyper.fused_ops`) on a dense SwiGLU
or an attention without an output bias; elsewhere the unfused path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from birkhoff.kernels import mhc
from birkhoff.model.hyper import HyperConnection, fused_ops
from birkhoff.model.layers import Attention, RMSNorm, SwiGLU, swiglu


def folds(hc: nn.Module, x_BTSD: Tensor) -> bool:
    """Whether the sublayer behind `hc` can run folded: an mHC wrapper on the fused ops."""
    return isinstance(hc, HyperConnection) and fused_ops(x_BTSD, hc.kernels) is not None


def _entry(
    hc: HyperConnection, norm: RMSNorm, x_BTSD: Tensor, weight: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(the sublayer's normalised input in the GEMMs' dtype, H_post, H_res, x for mix out)."""
    dtype = _compute_dtype(x_BTSD, weight)
    return mhc.fold_entry(
        x_BTSD,
        hc.phi,
        hc.alpha,
        hc.bias,
        norm.weight,
        iters=hc.iters,
        norm_eps=hc.norm_eps,
        eps=hc.eps,
        rms_eps=norm.eps,
        dtype=dtype,
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
    """The attention sublayer with its mixes folded into the passes around QKV and output."""
    assert isinstance(hc, HyperConnection), "check attention_folds first"
    a_BTD, post, res, x_BTSD = _entry(hc, norm, x_BTSD, attn.wq.weight)
    w_ZD = torch.cat((attn.wq.weight, attn.wk.weight, attn.wv.weight)).to(a_BTD.dtype)
    bias = None if attn.wq.bias is None else torch.cat((attn.wq.bias, attn.wk.bias, attn.wv.bias))
    qkv_BTZ = F.linear(a_BTD, w_ZD, None if bias is None else bias.to(a_BTD.dtype))
    sizes = (attn.wq.out_features, attn.wk.out_features, attn.wv.out_features)
    q, k, v = qkv_BTZ.split(sizes, dim=-1)
    return mhc.mix_out(x_BTSD, attn.wo(attn.heads(q, k, v, rope)), post, res)


def mlp_sublayer(hc: nn.Module, norm: RMSNorm, mlp: nn.Module, x_BTSD: Tensor) -> Tensor:
    """The SwiGLU sublayer with its mixes folded into the passes around gate/up and down."""
    assert isinstance(hc, HyperConnection) and type(mlp) is SwiGLU, "check mlp_folds first"
    a_BTD, post, res, x_BTSD = _entry(hc, norm, x_BTSD, mlp.w_gate.weight)
    w_ZD = torch.cat((mlp.w_gate.weight, mlp.w_up.weight)).to(a_BTD.dtype)
    act_BTZ = swiglu(*F.linear(a_BTD, w_ZD).chunk(2, dim=-1))
    return mhc.mix_out(x_BTSD, mlp.w_down(act_BTZ), post, res)


def attention_folds(hc: nn.Module, attn: nn.Module, x_BTSD: Tensor) -> bool:
    """Exactly `Attention` (a subclass may compute otherwise), without an output bias."""
    return folds(hc, x_BTSD) and type(attn) is Attention and attn.wo.bias is None


def mlp_folds(hc: nn.Module, mlp: nn.Module, x_BTSD: Tensor) -> bool:
    """Exactly the dense `SwiGLU` (MoE layers and variants run unfolded)."""
    return folds(hc, x_BTSD) and type(mlp) is SwiGLU
