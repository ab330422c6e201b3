"""Mix in + RMSNorm as one row pass ahead of the GEMM that consumes them, with autograd.

Legend: B batch, T tokens (any leading shape; N = B*T rows), S streams, D model dim, Z output
features (the QKV or gate/up weights, concatenated), P coefficient logits.

`mix_norm_fwd` holds BN whole rows a program: y = sum_s h_s x_s in fp32, r = 1/rms(y), and
A = y r w_n written once in the GEMM's dtype (y is not rounded first); torch's GEMM takes A.
`mix_norm_bwd` (rows again whole, TOKENS tokens a program) reduces c = <g_A w_n, y r> / D and
writes g_y = r (g_A w_n - y r c), g_h = <g_y, x_s> and w_n's partials.
`fold_entry` is the folded sublayer's entry: the coefficient op and this pass as one autograd
node that also gives x back as a view, so its backward hands g_y, g_h and mix out's g_x to the
coefficient op's backward, which writes x's gradient once (`coefficients.coefficient_grads`).
Not a GEMM prologue: that redoes the mix for each of the Z/BN column blocks on CUDA cores
beside the tensor cores, and reads the streams twice (docs/mhc.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from birkhoff.kernels.common import cdiv, check_inputs, pow2, tl, triton
from birkhoff.kernels.fused_op import FusedOp, traceable
from birkhoff.kernels.mhc import coefficients as coef
from birkhoff.kernels.mhc.coefficients import f32
from birkhoff.kernels.mhc.configs import CONFIG, Launch


@triton.jit
def mixed_tile(x_ptr, h_ptr, n64, n_ok, d, D, S: tl.constexpr):
    """y = sum_s h[n, s] x[n, s, d] in fp32 for the [BN, BD] tile (n64, d); 0 outside."""
    ok = n_ok[:, None] & (d < D)[None, :]
    row = n64[:, None] * (S * D) + d[None, :]
    h = tl.load(h_ptr + n64 * S, mask=n_ok, other=0.0)
    y = h[:, None] * tl.load(x_ptr + row, mask=ok, other=0.0).to(tl.float32)
    for s in tl.static_range(1, S):
        h = tl.load(h_ptr + n64 * S + s, mask=n_ok, other=0.0)
        y += h[:, None] * tl.load(x_ptr + row + s * D, mask=ok, other=0.0).to(tl.float32)
    return y


@triton.jit
def mix_norm_fwd(
    x_ptr,
    h_ptr,
    wn_ptr,
    a_ptr,
    rstd_ptr,
    N,
    D,
    eps,
    S: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """A[n] = y[n] r[n] w_n, r = 1 / sqrt(mean_d y^2 + eps): BN whole rows (BD >= D)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    d = tl.arange(0, BD)
    n_ok, n64 = n < N, n.to(tl.int64)
    y = mixed_tile(x_ptr, h_ptr, n64, n_ok, d, D, S)
    r = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) / D + f32(eps))
    wn = tl.load(wn_ptr + d, mask=d < D, other=0.0)
    a = (y * r[:, None] * wn[None, :]).to(a_ptr.dtype.element_ty)
    tl.store(a_ptr + n64[:, None] * D + d[None, :], a, mask=n_ok[:, None] & (d < D)[None, :])
    tl.store(rstd_ptr + n64, r, mask=n_ok)


@triton.jit
def _write_grads(g_ptr, gh_ptr, x_ptr, gy, n64, n_ok, d, D, S: tl.constexpr):
    """g_y into g_ptr [N, D]; g_h[n, s] = <g_y, x_s> into gh_ptr [N, S]."""
    ok = n_ok[:, None] & (d < D)[None, :]
    tl.store(g_ptr + n64[:, None] * D + d[None, :], gy.to(g_ptr.dtype.element_ty), mask=ok)
    row = n64[:, None] * (S * D) + d[None, :]
    for s in tl.static_range(S):
        xv = tl.load(x_ptr + row + s * D, mask=ok, other=0.0).to(tl.float32)
        tl.store(gh_ptr + n64 * S + s, tl.sum(xv * gy, axis=1), mask=n_ok)


@triton.jit
def mix_norm_bwd(
    ga_ptr,
    x_ptr,
    h_ptr,
    rstd_ptr,
    wn_ptr,
    g_ptr,
    gh_ptr,
    gw_ptr,
    N,
    D,
    TOKENS,
    S: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """g_y = r (g_A w_n - y_hat c), c = <g_A w_n, y_hat> / D, y_hat = y r (`_write_grads`
    stores it); gw_ptr [programs, D]: partials of sum_n g_A y_hat. TOKENS tokens a program,
    BN whole rows (BD >= D) at a time."""
    d = tl.arange(0, BD)
    wn = tl.load(wn_ptr + d, mask=d < D, other=0.0)
    gw = tl.zeros([BD], dtype=tl.float32)
    for t in range(0, TOKENS, BN):
        n = tl.program_id(0) * TOKENS + t + tl.arange(0, BN)
        n_ok, n64 = n < N, n.to(tl.int64)
        r = tl.load(rstd_ptr + n64, mask=n_ok, other=0.0)
        y_hat = mixed_tile(x_ptr, h_ptr, n64, n_ok, d, D, S) * r[:, None]
        ok = n_ok[:, None] & (d < D)[None, :]
        ga = tl.load(ga_ptr + n64[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
        gw += tl.sum(ga * y_hat, axis=0)
        gn = ga * wn[None, :]
        c = tl.sum(gn * y_hat, axis=1) / D
        gy = r[:, None] * (gn - y_hat * c[:, None])
        _write_grads(g_ptr, gh_ptr, x_ptr, gy, n64, n_ok, d, D, S)
    tl.store(gw_ptr + tl.program_id(0).to(tl.int64) * D + d, gw, mask=d < D)


def row_launch(N: int, D: int) -> tuple[int, Launch]:
    """(BN, launch parameters) of the row passes: whole rows (BD = D padded to a power of two),
    BN of them making about CONFIG["fold_norm"]["ELEMENTS"], warps to match; TOKENS tokens a
    backward program, for about PROGRAMS programs."""
    cfg = dict(CONFIG["fold_norm"])
    bd = max(16, pow2(D))
    bn = max(1, int(cfg.pop("ELEMENTS")) // bd)
    warps = min(16, max(4, bn * bd // 512))
    tokens = bn * max(1, cdiv(N, bn * int(cfg.pop("PROGRAMS"))))
    return bn, dict(BN=bn, BD=bd, num_warps=warps, TOKENS=tokens)


def _forward_impl(
    x_BTSD: Tensor, h_BTS: Tensor, wn_D: Tensor, eps: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(A = RMSNorm(sum_s h_s x_s; w_n) [B,T,D] in `dtype`, rstd [B,T] fp32 for the backward)."""
    S, D = x_BTSD.shape[-2:]
    N = h_BTS.numel() // S
    a = x_BTSD.new_empty((*x_BTSD.shape[:-2], D), dtype=dtype)
    rstd = x_BTSD.new_empty(x_BTSD.shape[:-2], dtype=torch.float32)
    if N:
        bn, cfg = row_launch(N, D)
        cfg.pop("TOKENS")
        grid = (cdiv(N, bn),)
        traceable(mix_norm_fwd)[grid](x_BTSD, h_BTS, wn_D, a, rstd, N, D, eps, S=S, **cfg)
    return a, rstd


def _forward_fake(x_BTSD, h_BTS, wn_D, eps, dtype):  # type: ignore[no-untyped-def]
    a = x_BTSD.new_empty((*x_BTSD.shape[:-2], x_BTSD.shape[-1]), dtype=dtype)
    return a, x_BTSD.new_empty(x_BTSD.shape[:-2], dtype=torch.float32)


_op = FusedOp("mhc_mix_norm", _forward_impl, _forward_fake)


def _backward_impl(
    g_A: Tensor, x_BTSD: Tensor, h_BTS: Tensor, wn_D: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(g_y [B,T,D] in x's dtype, g_h [B,T,S], g_w_n [D] fp32); g_y: the mix's gradient."""
    S, D = x_BTSD.shape[-2:]
    N = rstd.numel()
    g_y, g_h = x_BTSD.new_empty((*x_BTSD.shape[:-2], D)), torch.empty_like(h_BTS)
    if not N:
        return g_y, g_h, torch.zeros_like(wn_D)
    _, cfg = row_launch(N, D)
    tokens = int(cfg.pop("TOKENS"))
    grid = (cdiv(N, tokens),)
    parts_w = rstd.new_empty((grid[0], D))
    args = (g_A, x_BTSD, h_BTS, rstd, wn_D, g_y, g_h, parts_w, N, D, tokens)
    traceable(mix_norm_bwd)[grid](*args, S=S, **cfg)
    return g_y, g_h, parts_w.sum(0)


def _backward_fake(g_A, x_BTSD, h_BTS, wn_D, rstd):  # type: ignore[no-untyped-def]
    g_y = x_BTSD.new_empty((*x_BTSD.shape[:-2], x_BTSD.shape[-1]))
    return g_y, torch.empty_like(h_BTS), torch.empty_like(wn_D)


_bwd_op = FusedOp("mhc_mix_norm_bwd", _backward_impl, _backward_fake)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x_BTSD, h_BTS, wn_D, _eps, _dtype = inputs
    ctx.save_for_backward(x_BTSD, h_BTS, wn_D, output[1])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, g_A, _g_rstd):  # type: ignore[no-untyped-def]
    x_BTSD, h_BTS = ctx.saved_tensors[:2]
    g_y, g_h, g_wn = _bwd_op(g_A.contiguous(), *ctx.saved_tensors)
    g_x = h_BTS[..., None] * g_y[..., None, :].float()  # [B,T,S,D]
    return g_x.to(x_BTSD.dtype), g_h, g_wn, None, None


_op.register_autograd(_backward, setup_context=_setup)


def _check(x_BTSD: Tensor, h_pre_BTS: Tensor, norm_w_D: Tensor) -> None:
    check_inputs(x_BTSD)
    if h_pre_BTS.shape != x_BTSD.shape[:-1] or tuple(norm_w_D.shape) != x_BTSD.shape[-1:]:
        shapes = (tuple(h_pre_BTS.shape), tuple(norm_w_D.shape), tuple(x_BTSD.shape))
        raise ValueError("h_pre {} / norm weight {} do not fit x {}".format(*shapes))


def mix_norm(
    x_BTSD: Tensor, h_pre_BTS: Tensor, norm_w_D: Tensor, *, eps: float, dtype: torch.dtype
) -> Tensor:
    """Fused RMSNorm(sum_s h_s x_s; norm_w) -> [B,T,D] in `dtype`, mixed and normalised in
    fp32 (rounded once, to `dtype`)."""
    _check(x_BTSD, h_pre_BTS, norm_w_D)
    h, wn = h_pre_BTS.float().contiguous(), norm_w_D.float().contiguous()
    return _op(x_BTSD.contiguous(), h, wn, eps, dtype)[0]  # type: ignore[no-any-return]


def mix_norm_linear(
    x_BTSD: Tensor, h_pre_BTS: Tensor, norm_w_D: Tensor, w_ZD: Tensor, *, eps: float
) -> Tensor:
    """RMSNorm(sum_s h_s x_s; norm_w) @ W^T -> [B,T,Z] in W's dtype (pass W cast to the
    autocast dtype to multiply in it): `mix_norm`, then torch's GEMM."""
    if w_ZD.dim() != 2 or w_ZD.shape[1] != x_BTSD.shape[-1]:
        raise ValueError(f"W {tuple(w_ZD.shape)} does not fit D={x_BTSD.shape[-1]}")
    return F.linear(mix_norm(x_BTSD, h_pre_BTS, norm_w_D, eps=eps, dtype=w_ZD.dtype), w_ZD)


class _FoldEntry(torch.autograd.Function):
    """The coefficient op and `mix_norm` as one node, which also gives x back as a view (see
    `coefficients._CoefficientsMixInStreams`); its backward writes x's gradient once."""

    @staticmethod
    def forward(ctx, x_BTSD, phi_PC, alpha, bias_P, wn_D, iters, norm_eps, eps, rms_eps, dtype):  # type: ignore[no-untyped-def]
        inputs = (x_BTSD, phi_PC, alpha, bias_P, iters, True, False, norm_eps, eps)
        pre, post, res, y, raw_BTP, rstd_BT = coef.coefficients_op(*inputs)
        a_BTD, rstd_n = _op(x_BTSD, pre, wn_D, rms_eps, dtype)
        coef.save_coefficients(ctx, inputs, (pre, post, res, y, raw_BTP, rstd_BT), wn_D, rstd_n)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros
        return a_BTD, post, res, x_BTSD.view_as(x_BTSD)

    @staticmethod
    def backward(ctx, g_A, g_post, g_res, g_r):  # type: ignore[no-untyped-def]
        *saved, wn_D, rstd_n = ctx.saved_tensors
        x_BTSD, pre = saved[0], saved[2]
        g_y, g_pre, g_wn = _bwd_op(g_A.contiguous(), x_BTSD, pre, wn_D, rstd_n)
        grads = coef.coefficient_grads(
            saved, ctx.hyper, g_pre, g_post, g_res, g_y, g_r, mix_reduced=True
        )
        return *grads, g_wn, None, None, None, None, None


def fold_entry(
    x_BTSD: Tensor,
    phi_PC: Tensor,
    alpha_3: Tensor,
    bias_P: Tensor,
    norm_w_D: Tensor,
    *,
    iters: int,
    norm_eps: float,
    eps: float,
    rms_eps: float,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(RMSNorm(sum_s H_pre[s] x_s; norm_w) [B,T,D] in `dtype`, H_post, H_res, x again as a
    view for mix out to read): the folded sublayer's entry, one autograd node."""
    inputs = coef.op_inputs(x_BTSD, phi_PC, alpha_3, bias_P)
    wn = norm_w_D.float().contiguous()
    if tuple(wn.shape) != x_BTSD.shape[-1:]:
        raise ValueError(f"norm weight {tuple(wn.shape)} does not fit x {tuple(x_BTSD.shape)}")
    args = (iters, norm_eps, eps, rms_eps, dtype)
    return _FoldEntry.apply(*inputs, wn, *args)  # type: ignore[no-any-return]
