"""The engine's mHC sublayer entry as one fused forward-only op: coefficients, mix in and the
sublayer's RMSNorm (`birkhoff::mhc_mix_in_norm`, kernel: `mhc_decode_triton.mix_in_norm`).

Legend: B batch, T tokens (any leading shape works), S streams, D model dim, C = S*D,
P coefficient logits, PP: P padded.

`mix_in_norm(x, phi, alpha, bias, weight, ...)` returns (h = RMSNorm(sum_j H_pre[j] x_j) *
weight, H_pre, H_post, H_res): what `hyper.hyper_connection` computes before its sublayer,
with the sublayer's pre-norm folded in (`with_res=False`: the output contraction and final
norm, H_post and H_res of shape [0]). The engine calls it for every chunk (decode, verify,
draft, prefill): it has no backward, and the trainer keeps `mhc.coefficients_and_mix_in` and
`layers.rms_norm`. Its numbers are those ops' (the same `project` and `coefficients` Triton
code, the mix accumulated in fp32 and rounded to x's dtype before its RMS), so an engine on
these kernels matches one on the separate fused ops to rounding.

Launch: token blocks of `CONFIG["mix_in_norm"]["BN"]` tokens (>= 16, what tl.dot needs) times
column splits, about PROGRAMS programs in all and at most SPLITS splits (`mhc.split_columns`:
every split is a partial the last program waits to read); a block's last program runs the
per-token rest. One int32 counter per token block (`counters`): zero between launches, kept
per device and never freed (captured graphs hold their address).
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import mhc_decode_triton as K
from birkhoff.kernels.mhc import split_columns
from birkhoff.kernels.mhc_configs import CONFIG
from birkhoff.kernels.mhc_mix import INTERPRET, cdiv, check_inputs, pad_streams, pow2
from birkhoff.kernels.mhc_phi import is_served, padded_logits, projection_phi
from birkhoff.kernels.ops import FusedOp, traceable, traced

_COUNTERS: dict[torch.device, list[Tensor]] = {}


def counters(like: Tensor, blocks: int) -> Tensor:
    """At least `blocks` zeroed int32 counters on `like`'s device. Every launch leaves them
    zero; a larger set replaces the current one, and the old ones stay allocated (a captured
    graph may still count on them). Traced (torch.compile, fake tensors): fresh zeros, a node of
    the traced graph, so no traced tensor is kept."""
    if torch.compiler.is_compiling() or traced((like,)):
        return torch.zeros(blocks, dtype=torch.int32, device=like.device)
    held = _COUNTERS.setdefault(like.device, [])
    if not held or held[-1].numel() < blocks:
        held.append(torch.zeros(max(blocks, 4096), dtype=torch.int32, device=like.device))
    return held[-1]


def _impl(
    x_BTSD: Tensor, phi_PC: Tensor, alpha: Tensor, bias_P: Tensor, weight_D: Tensor,
    iters: int, with_res: bool, norm_eps: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    h, pre, post, res = _fake(x_BTSD, phi_PC, alpha, bias_P, weight_D, iters, with_res)
    S, D = x_BTSD.shape[-2:]
    N, C, P = pre.numel() // S, S * D, phi_PC.shape[0]
    if not N:
        return h, pre, post, res
    fp32 = x_BTSD.dtype == torch.float32
    cfg = dict(CONFIG["mix_in_norm_fp32" if fp32 else "mix_in_norm"])
    bn, bc, programs = int(cfg.pop("BN")), int(cfg.pop("BC")), int(cfg.pop("PROGRAMS"))
    tail, most = int(cfg.pop("TAIL_ELEMENTS")), int(cfg.pop("SPLITS"))
    blocks = cdiv(N, bn)
    chunk, splits = split_columns(C, bc, blocks, programs, most)
    PP = padded_logits(P)
    part = x_BTSD.new_empty((splits, N, PP), dtype=torch.float32)
    sq = x_BTSD.new_empty((splits, N), dtype=torch.float32)
    raw, rstd = x_BTSD.new_empty((N, P), dtype=torch.float32), sq.new_empty((N,))
    traceable(K.mix_in_norm)[(blocks, splits)](
        x_BTSD, projection_phi(phi_PC, 1), alpha, bias_P, weight_D, part, sq, raw, rstd,
        counters(x_BTSD, blocks), h, pre, post, res, N, C, D, chunk, splits, norm_eps,
        eps, iters, S=S, SP=pad_streams(S), P=P, PP=PP, WITH_RES=with_res,
        PREC="ieee" if fp32 else "tf32x3", BN=bn, BC=bc, BD=min(int(cfg.pop("BD")), pow2(D)),
        KB=min(pow2(splits), max(1, tail // (bn * PP))), EMU=INTERPRET, **cfg,
    )  # fmt: skip
    return h, pre, post, res


def _fake(
    x_BTSD: Tensor, phi_PC: Tensor, alpha: Tensor, bias_P: Tensor, weight_D: Tensor,
    iters: int, with_res: bool, *_: object,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    lead, (S, D) = tuple(x_BTSD.shape[:-2]), x_BTSD.shape[-2:]
    out = x_BTSD.new_empty
    f32 = torch.float32
    return (
        out((*lead, D)), out((*lead, S), dtype=f32),
        out((*lead, S) if with_res else (0,), dtype=f32),
        out((*lead, S, S) if with_res else (0,), dtype=f32),
    )  # fmt: skip


_op = FusedOp("mhc_mix_in_norm", _impl, _fake)


def mix_in_norm(
    x_BTSD: Tensor, phi_PC: Tensor, alpha: Tensor, bias_P: Tensor, weight_D: Tensor, *,
    iters: int, norm_eps: float, eps: float, with_res: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(RMSNorm(sum_j H_pre[j] x_j) * weight [B,T,D] in x's dtype, H_pre, H_post, H_res in fp32)
    of streams x [B,T,S,D]; norm_eps is both RMS epsilons (the coefficients' and the norm's)."""
    check_inputs(x_BTSD, phi_PC, weight_D)
    if weight_D.shape != x_BTSD.shape[-1:]:
        raise ValueError(f"weight has shape {tuple(weight_D.shape)}, x {tuple(x_BTSD.shape)}")
    return _op(  # type: ignore[no-any-return]
        x_BTSD.contiguous(), phi_PC if is_served(phi_PC) else phi_PC.contiguous(),
        alpha.float().contiguous(), bias_P.float().contiguous(), weight_D.contiguous(),
        iters, with_res, norm_eps, eps,
    )  # fmt: skip
