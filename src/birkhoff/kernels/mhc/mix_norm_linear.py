"""Mix in + RMSNorm as a GEMM prologue, with autograd: out = RMSNorm(sum_s h_s x_s; w_n) @ W^T.

Legend: B batch, T tokens (any leading shape; N = B*T rows), S streams, D model dim, Z output
features (the QKV or gate/up weights, concatenated).

Forward: `mix_rstd` reads the streams once for each token's inverse RMS r of y = sum_s h_s x_s
(the norm needs the whole row before a column is scaled); `mix_norm_matmul` reads them again in
its A-tile loads (S tiles mixed in fp32, times r and w_n, cast to W's dtype) and multiplies with
fp32 accumulators, so neither y nor the normalised input goes to HBM. y is not rounded to the
streams' dtype before the norm (the unfused path rounds it once). Backward: g_A = g_out W and
g_W = g_out^T A (torch's GEMMs; `norm_bwd_dot` rebuilds A and reduces c = <g_A w_n, y r> and
w_n's partial gradients), then `norm_bwd_dx` writes g_x = h r (g_A w_n - y r c / D) and g_h's
partials. Reductions come as per-block partials summed by torch (no atomics).
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import check_inputs, tl, triton
from birkhoff.kernels.fused_op import FusedOp, traceable
from birkhoff.kernels.mhc.coefficients import f32
from birkhoff.kernels.mhc.fold_gemm import (
    dot_acc,
    gemm_launch,
    gemm_tile,
    load_wt,
    row_launch,
    sum_parts,
)
from birkhoff.kernels.mhc.mixes import tile


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
def mix_rstd(
    x_ptr, h_ptr, rstd_ptr, N, D, eps, S: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr
):
    """rstd[n] = 1 / sqrt(mean_d y[n, d]^2 + eps), one program per BN tokens over all of D."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok, n64 = n < N, n.to(tl.int64)
    sq = tl.zeros([BN], dtype=tl.float32)
    for d0 in range(0, D, BD):
        y = mixed_tile(x_ptr, h_ptr, n64, n_ok, d0 + tl.arange(0, BD), D, S)
        sq += tl.sum(y * y, axis=1)
    tl.store(rstd_ptr + n64, 1.0 / tl.sqrt(sq / D + f32(eps)), mask=n_ok)


@triton.jit
def mix_norm_matmul(
    x_ptr,
    h_ptr,
    rstd_ptr,
    wn_ptr,
    w_ptr,
    out_ptr,
    N,
    D,
    Z,
    S: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
    EMU: tl.constexpr,
):
    """out[n, o] = sum_d (r[n] w_n[d] sum_s h[n, s] x[n, s, d]) W[o, d], A built in the loads."""
    m, cols = gemm_tile(N, Z, BM, BN, GROUP_M)
    m_ok, col_ok, m64 = m < N, cols < Z, m.to(tl.int64)
    r = tl.load(rstd_ptr + m64, mask=m_ok, other=0.0)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        wn = tl.load(wn_ptr + k, mask=k < D, other=0.0)
        a = mixed_tile(x_ptr, h_ptr, m64, m_ok, k, D, S) * r[:, None] * wn[None, :]
        b = load_wt(w_ptr, cols, col_ok, k, D)
        acc = dot_acc(a.to(b.dtype), b, acc, IEEE, EMU)
    ok = m_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + m64[:, None] * Z + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_tiles(ga_ptr, x_ptr, h_ptr, rstd_ptr, wn_ptr, N, D, S: tl.constexpr, BN, BD):
    """(tile indices, r, y_hat = y r, g_A, w_n) of this program's [BN, BD] tile, in fp32."""
    n64, n_ok, d, ok = tile(N, D, BN, BD)
    r = tl.load(rstd_ptr + n64, mask=n_ok, other=0.0)
    y_hat = mixed_tile(x_ptr, h_ptr, n64, n_ok, d, D, S) * r[:, None]
    wn = tl.load(wn_ptr + d, mask=d < D, other=0.0)
    ga = tl.load(ga_ptr + n64[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    return n64, n_ok, d, ok, r, y_hat, ga, wn


@triton.jit
def norm_bwd_dot(
    ga_ptr,
    x_ptr,
    h_ptr,
    rstd_ptr,
    wn_ptr,
    a_ptr,
    c_ptr,
    gw_ptr,
    N,
    D,
    S: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """A = y_hat w_n (for g_W); c_ptr: [ND, N] partials of <g_A w_n, y_hat>; gw_ptr: [NB, D]
    partials of sum_n g_A y_hat (w_n's gradient)."""
    n64, n_ok, d, ok, _, y_hat, ga, wn = _norm_tiles(
        ga_ptr, x_ptr, h_ptr, rstd_ptr, wn_ptr, N, D, S, BN, BD
    )
    a = (y_hat * wn[None, :]).to(a_ptr.dtype.element_ty)
    tl.store(a_ptr + n64[:, None] * D + d[None, :], a, mask=ok)
    c = tl.sum(ga * wn[None, :] * y_hat, axis=1)
    tl.store(c_ptr + tl.program_id(1).to(tl.int64) * N + n64, c, mask=n_ok)
    gw = tl.sum(ga * y_hat, axis=0)
    tl.store(gw_ptr + tl.program_id(0).to(tl.int64) * D + d, gw, mask=d < D)


@triton.jit
def norm_bwd_dx(
    ga_ptr,
    x_ptr,
    h_ptr,
    rstd_ptr,
    wn_ptr,
    c_ptr,
    gx_ptr,
    gh_ptr,
    N,
    D,
    S: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """g_y = r (g_A w_n - y_hat c / D); g_x[s] = h_s g_y; gh_ptr: [ND, N, S] partials of
    <g_y, x_s>."""
    n64, n_ok, d, ok, r, y_hat, ga, wn = _norm_tiles(
        ga_ptr, x_ptr, h_ptr, rstd_ptr, wn_ptr, N, D, S, BN, BD
    )
    c = tl.load(c_ptr + n64, mask=n_ok, other=0.0) / D
    gy = r[:, None] * (ga * wn[None, :] - y_hat * c[:, None])
    row = n64[:, None] * (S * D) + d[None, :]
    part = gh_ptr + (tl.program_id(1).to(tl.int64) * N + n64) * S
    for s in tl.static_range(S):
        h = tl.load(h_ptr + n64 * S + s, mask=n_ok, other=0.0)
        tl.store(gx_ptr + row + s * D, (h[:, None] * gy).to(gx_ptr.dtype.element_ty), mask=ok)
        xv = tl.load(x_ptr + row + s * D, mask=ok, other=0.0).to(tl.float32)
        tl.store(part + s, tl.sum(xv * gy, axis=1), mask=n_ok)


def _forward_impl(
    x_BTSD: Tensor, h_BTS: Tensor, wn_D: Tensor, w_ZD: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """(out [B,T,Z] in W's dtype, rstd [B,T] fp32, saved for the backward)."""
    S, D = x_BTSD.shape[-2:]
    Z, N = w_ZD.shape[0], h_BTS.numel() // S
    out = x_BTSD.new_empty((*x_BTSD.shape[:-2], Z), dtype=w_ZD.dtype)
    rstd = x_BTSD.new_empty(x_BTSD.shape[:-2], dtype=torch.float32)
    if not N:
        return out, rstd
    rows, cfg = row_launch(N, S, D)
    traceable(mix_rstd)[(rows[0],)](x_BTSD, h_BTS, rstd, N, D, eps, S=S, **cfg)
    grid, cfg = gemm_launch(N, Z, D, w_ZD.dtype)
    traceable(mix_norm_matmul)[grid](x_BTSD, h_BTS, rstd, wn_D, w_ZD, out, N, D, Z, S=S, **cfg)
    return out, rstd


def _forward_fake(x_BTSD, h_BTS, wn_D, w_ZD, eps):  # type: ignore[no-untyped-def]
    out = x_BTSD.new_empty((*x_BTSD.shape[:-2], w_ZD.shape[0]), dtype=w_ZD.dtype)
    return out, x_BTSD.new_empty(x_BTSD.shape[:-2], dtype=torch.float32)


_op = FusedOp("mhc_mix_norm_linear", _forward_impl, _forward_fake)


def _backward_impl(
    g_BTZ: Tensor, x_BTSD: Tensor, h_BTS: Tensor, wn_D: Tensor, w_ZD: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(g_x, g_h [B,T,S] fp32, g_w_n [D] fp32, g_W [Z, D] in W's dtype)."""
    S, D = x_BTSD.shape[-2:]
    N = rstd.numel()
    g_x = torch.empty_like(x_BTSD)
    if not N:
        return g_x, torch.zeros_like(h_BTS), torch.zeros_like(wn_D), torch.zeros_like(w_ZD)
    g_ND = g_BTZ.reshape(N, -1)
    ga_ND = g_ND @ w_ZD  # the normalised input's gradient, in W's dtype
    a_ND = ga_ND.new_empty((N, D))
    grid, cfg = row_launch(N, S, D)
    parts_c = rstd.new_empty((grid[1], N))
    parts_w = rstd.new_empty((grid[0], D))
    args = (ga_ND, x_BTSD, h_BTS, rstd, wn_D)
    traceable(norm_bwd_dot)[grid](*args, a_ND, parts_c, parts_w, N, D, S=S, **cfg)
    g_w = g_ND.t() @ a_ND
    parts_h = rstd.new_empty((grid[1], *h_BTS.shape))
    c = sum_parts(parts_c).contiguous()
    traceable(norm_bwd_dx)[grid](*args, c, g_x, parts_h, N, D, S=S, **cfg)
    return g_x, sum_parts(parts_h), sum_parts(parts_w), g_w


def _backward_fake(g_BTZ, x_BTSD, h_BTS, wn_D, w_ZD, rstd):  # type: ignore[no-untyped-def]
    return tuple(torch.empty_like(t) for t in (x_BTSD, h_BTS, wn_D, w_ZD))


_bwd_op = FusedOp("mhc_mix_norm_linear_bwd", _backward_impl, _backward_fake)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x_BTSD, h_BTS, wn_D, w_ZD, _eps = inputs
    ctx.save_for_backward(x_BTSD, h_BTS, wn_D, w_ZD, output[1])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, g_BTZ, _g_rstd):  # type: ignore[no-untyped-def]
    return *_bwd_op(g_BTZ.contiguous(), *ctx.saved_tensors), None


_op.register_autograd(_backward, setup_context=_setup)


def mix_norm_linear(
    x_BTSD: Tensor, h_pre_BTS: Tensor, norm_w_D: Tensor, w_ZD: Tensor, *, eps: float
) -> Tensor:
    """Fused RMSNorm(sum_s h_s x_s; norm_w) @ W^T -> [B,T,Z] in W's dtype (pass W cast to the
    autocast dtype to multiply in it), mixed and normalised in fp32."""
    check_inputs(x_BTSD, w_ZD)
    S, D = x_BTSD.shape[-2:]
    if w_ZD.dim() != 2 or w_ZD.shape[1] != D or tuple(norm_w_D.shape) != (D,):
        raise ValueError(f"W {tuple(w_ZD.shape)} / norm {tuple(norm_w_D.shape)} do not fit D={D}")
    if h_pre_BTS.shape != x_BTSD.shape[:-1]:
        raise ValueError(f"h_pre {tuple(h_pre_BTS.shape)} does not fit x {tuple(x_BTSD.shape)}")
    h, wn = h_pre_BTS.float().contiguous(), norm_w_D.float().contiguous()
    return _op(x_BTSD.contiguous(), h, wn, w_ZD.contiguous(), eps)[0]  # type: ignore[no-any-return]
