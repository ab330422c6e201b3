"""Fused stream mixes with autograd: mix in (y = sum_j h[j] x_j) and mix out
(y_k = H_post[k] F + sum_j H_res[j, k] x_j), forward and backward kernels and their ops.

Legend: B batch, T tokens (any leading shape; the kernels see N = B*T rows), S streams, D model
dim; ND: number of D blocks.

Each kernel works on [BN tokens, BD columns] tiles of every stream (grid: token blocks x D
blocks, `CONFIG["mix"]`), stream loops unrolled, sums over streams in fp32. Reductions over D
(g_h, g_post, g_res) come as one partial per D block, summed by torch in a fixed order (no
atomics). The ops are `FusedOp`s (`birkhoff::mhc_mix_*`); `mix_in_into` and
`mix_in_weight_grad` are the launches the coefficient op reuses when it mixes in itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import cdiv, check_inputs, pow2, tl, triton
from birkhoff.kernels.fused_op import FusedOp, traceable
from birkhoff.kernels.mhc.configs import CONFIG


@triton.jit
def tile(N, D, BN: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    n_ok = n < N
    return n.to(tl.int64), n_ok, d, n_ok[:, None] & (d < D)[None, :]


@triton.jit
def mix_in_fwd(x_ptr, h_ptr, y_ptr, N, D, S: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    n64, n_ok, d, ok = tile(N, D, BN, BD)
    row = n64[:, None] * (S * D) + d[None, :]
    y = tl.zeros([BN, BD], dtype=tl.float32)
    for j in tl.static_range(S):
        h = tl.load(h_ptr + n64 * S + j, mask=n_ok, other=0.0)
        y += h[:, None] * tl.load(x_ptr + row + j * D, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n64[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def mix_in_bwd(
    gy_ptr,
    x_ptr,
    h_ptr,
    gx_ptr,
    gh_ptr,
    N,
    D,
    S: tl.constexpr,
    WRITE_GX: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """gh_ptr: [ND, N, S] partials; g_x only if WRITE_GX (else the coefficient backward adds
    h g_y to its own g_x)."""
    n64, n_ok, d, ok = tile(N, D, BN, BD)
    row = n64[:, None] * (S * D) + d[None, :]
    gy = tl.load(gy_ptr + n64[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    part = gh_ptr + (tl.program_id(1).to(tl.int64) * N + n64) * S
    for j in tl.static_range(S):
        h = tl.load(h_ptr + n64 * S + j, mask=n_ok, other=0.0)
        if WRITE_GX:
            tl.store(gx_ptr + row + j * D, (h[:, None] * gy).to(gx_ptr.dtype.element_ty), mask=ok)
        xv = tl.load(x_ptr + row + j * D, mask=ok, other=0.0).to(tl.float32)
        tl.store(part + j, tl.sum(xv * gy, axis=1), mask=n_ok)


@triton.jit
def mix_out_stream(x_ptr, f, post_ptr, res_ptr, y_ptr, n64, n_ok, row, ok, k, S, D, BN, BD):
    """New stream k of the tile, sum_j h_res[j, k] x_j + h_post[k] f, stored; returns it as
    stored, in fp32."""
    y = tl.zeros([BN, BD], dtype=tl.float32)
    for j in tl.static_range(S):
        r = tl.load(res_ptr + n64 * (S * S) + j * S + k, mask=n_ok, other=0.0)
        y += r[:, None] * tl.load(x_ptr + row + j * D, mask=ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + n64 * S + k, mask=n_ok, other=0.0)
    y = (y + post[:, None] * f).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row + k * D, y, mask=ok)
    return y.to(tl.float32)


@triton.jit
def mix_out_fwd(
    x_ptr,
    f_ptr,
    post_ptr,
    res_ptr,
    y_ptr,
    N,
    D,
    S: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    n64, n_ok, d, ok = tile(N, D, BN, BD)
    row = n64[:, None] * (S * D) + d[None, :]
    f = tl.load(f_ptr + n64[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    for k in tl.static_range(S):
        mix_out_stream(x_ptr, f, post_ptr, res_ptr, y_ptr, n64, n_ok, row, ok, k, S, D, BN, BD)


@triton.jit
def mix_out_bwd(
    gy_ptr,
    x_ptr,
    f_ptr,
    post_ptr,
    res_ptr,
    gx_ptr,
    gf_ptr,
    gpost_ptr,
    gres_ptr,
    N,
    D,
    S: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """gpost_ptr: [ND, N, S] and gres_ptr: [ND, N, S, S] partials."""
    n64, n_ok, d, ok = tile(N, D, BN, BD)
    row = n64[:, None] * (S * D) + d[None, :]
    tok = tl.program_id(1).to(tl.int64) * N + n64  # row of this D block's partials
    f = tl.load(f_ptr + n64[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    gf = tl.zeros([BN, BD], dtype=tl.float32)
    for k in tl.static_range(S):
        gy = tl.load(gy_ptr + row + k * D, mask=ok, other=0.0).to(tl.float32)
        gf += tl.load(post_ptr + n64 * S + k, mask=n_ok, other=0.0)[:, None] * gy
        tl.store(gpost_ptr + tok * S + k, tl.sum(gy * f, axis=1), mask=n_ok)
    tl.store(gf_ptr + n64[:, None] * D + d[None, :], gf.to(gf_ptr.dtype.element_ty), mask=ok)
    for j in tl.static_range(S):
        xv = tl.load(x_ptr + row + j * D, mask=ok, other=0.0).to(tl.float32)
        gx = tl.zeros([BN, BD], dtype=tl.float32)
        for k in tl.static_range(S):
            gy = tl.load(gy_ptr + row + k * D, mask=ok, other=0.0).to(tl.float32)
            gx += tl.load(res_ptr + n64 * (S * S) + j * S + k, mask=n_ok, other=0.0)[:, None] * gy
            tl.store(gres_ptr + tok * (S * S) + j * S + k, tl.sum(xv * gy, axis=1), mask=n_ok)
        tl.store(gx_ptr + row + j * D, gx.to(gx_ptr.dtype.element_ty), mask=ok)


def _mix_grid(N: int, S: int, D: int) -> tuple[tuple[int, int], dict[str, int]]:
    """(grid: token blocks x D blocks, launch parameters) of the mix kernels (tuned at S = 4)."""
    cfg = {k: int(v) for k, v in CONFIG["mix"].items()}
    cfg["BD"] = min(cfg["BD"], max(16, pow2(D)))
    cfg["BN"] = max(1, cfg["BN"] * 4 // max(4, pow2(S)))  # S tiles live at once
    return (cdiv(N, cfg["BN"]), cdiv(D, cfg["BD"])), cfg


def _sum_parts(parts: Tensor) -> Tensor:
    """Sum of the per-D-block partials [ND, ...] in a fixed order (no copy when ND = 1)."""
    return parts[0] if parts.shape[0] == 1 else parts.sum(0)


def mix_in_into(y_BTD: Tensor, x_BTSD: Tensor, h_BTS: Tensor) -> None:
    """Write sum_j h[j] x_j into y_BTD (contiguous tensors, h in fp32)."""
    S, D = x_BTSD.shape[-2:]
    N = h_BTS.numel() // S
    grid, cfg = _mix_grid(N, S, D)
    if y_BTD.numel():
        traceable(mix_in_fwd)[grid](x_BTSD, h_BTS, y_BTD, N, D, S=S, **cfg)


def _mix_in_bwd(g_BTD: Tensor, x_BTSD: Tensor, h_BTS: Tensor, g_x: Tensor | None) -> Tensor:
    """g_h [B,T,S] (fp32); also g_x = h g_y into g_x unless it is None."""
    S, D = x_BTSD.shape[-2:]
    N = h_BTS.numel() // S
    grid, cfg = _mix_grid(N, S, D)
    if not x_BTSD.numel():
        return torch.zeros_like(h_BTS)
    parts = h_BTS.new_empty((grid[1], *h_BTS.shape))
    traceable(mix_in_bwd)[grid](
        g_BTD,
        x_BTSD,
        h_BTS,
        x_BTSD if g_x is None else g_x,
        parts,
        N,
        D,
        S=S,
        WRITE_GX=g_x is not None,
        **cfg,
    )
    return _sum_parts(parts)


def mix_in_weight_grad(g_BTD: Tensor, x_BTSD: Tensor, h_BTS: Tensor) -> Tensor:
    """g_h[j] = <g_y, x_j> [B,T,S] in fp32 for y = sum_j h[j] x_j (contiguous tensors)."""
    return _mix_in_bwd(g_BTD, x_BTSD, h_BTS, None)


def _mix_in_impl(x_BTSD: Tensor, h_BTS: Tensor) -> Tensor:
    y_BTD = x_BTSD.new_empty((*x_BTSD.shape[:-2], x_BTSD.shape[-1]))
    mix_in_into(y_BTD, x_BTSD, h_BTS)
    return y_BTD


def _mix_in_fake(x_BTSD, h_BTS):  # type: ignore[no-untyped-def]
    return x_BTSD.new_empty((*x_BTSD.shape[:-2], x_BTSD.shape[-1]))


_mix_in_op = FusedOp("mhc_mix_in", _mix_in_impl, _mix_in_fake)


def _mix_in_bwd_impl(g_BTD: Tensor, x_BTSD: Tensor, h_BTS: Tensor) -> tuple[Tensor, Tensor]:
    g_x = torch.empty_like(x_BTSD)
    return g_x, _mix_in_bwd(g_BTD, x_BTSD, h_BTS, g_x)


def _mix_in_bwd_fake(g_BTD, x_BTSD, h_BTS):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_BTSD), torch.empty_like(h_BTS)


_mix_in_bwd_op = FusedOp("mhc_mix_in_bwd", _mix_in_bwd_impl, _mix_in_bwd_fake)


def _mix_in_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def _mix_in_backward(ctx, g_BTD):  # type: ignore[no-untyped-def]
    return _mix_in_bwd_op(g_BTD.contiguous(), *ctx.saved_tensors)


_mix_in_op.register_autograd(_mix_in_backward, setup_context=_mix_in_setup)


def mix_in(x_BTSD: Tensor, h_BTS: Tensor) -> Tensor:
    """Fused sum_j h[j] x_j -> [B,T,D] in the dtype of x, accumulated in fp32."""
    check_inputs(x_BTSD)
    return _mix_in_op(x_BTSD.contiguous(), h_BTS.float().contiguous())


def _mix_out_impl(x_BTSD: Tensor, f_BTD: Tensor, post_BTS: Tensor, res_BTSS: Tensor) -> Tensor:
    S, D = x_BTSD.shape[-2:]
    y_BTSD = torch.empty_like(x_BTSD, dtype=torch.promote_types(x_BTSD.dtype, f_BTD.dtype))
    N = post_BTS.numel() // S
    grid, cfg = _mix_grid(N, S, D)
    if y_BTSD.numel():
        traceable(mix_out_fwd)[grid](x_BTSD, f_BTD, post_BTS, res_BTSS, y_BTSD, N, D, S=S, **cfg)
    return y_BTSD


def _mix_out_fake(x_BTSD, f_BTD, post_BTS, res_BTSS):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_BTSD, dtype=torch.promote_types(x_BTSD.dtype, f_BTD.dtype))


_mix_out_op = FusedOp("mhc_mix_out", _mix_out_impl, _mix_out_fake)


def mix_out_grads(
    g_BTSD: Tensor, x_BTSD: Tensor, f_BTD: Tensor, post_BTS: Tensor, res_BTSS: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(g_x, g_F, g_post, g_res) of mix out (contiguous tensors; post and res in fp32)."""
    S, D = x_BTSD.shape[-2:]
    g_x, g_f = torch.empty_like(x_BTSD), torch.empty_like(f_BTD)
    N = post_BTS.numel() // S
    grid, cfg = _mix_grid(N, S, D)
    if not g_x.numel():
        return g_x, g_f.zero_(), torch.zeros_like(post_BTS), torch.zeros_like(res_BTSS)
    parts_post = post_BTS.new_empty((grid[1], *post_BTS.shape))
    parts_res = res_BTSS.new_empty((grid[1], *res_BTSS.shape))
    traceable(mix_out_bwd)[grid](
        g_BTSD,
        x_BTSD,
        f_BTD,
        post_BTS,
        res_BTSS,
        g_x,
        g_f,
        parts_post,
        parts_res,
        N,
        D,
        S=S,
        **cfg,
    )
    g_post, g_res = _sum_parts(parts_post), _sum_parts(parts_res)
    return g_x, g_f, g_post, g_res


def _mix_out_bwd_fake(g_BTSD, x_BTSD, f_BTD, post_BTS, res_BTSS):  # type: ignore[no-untyped-def]
    return tuple(torch.empty_like(t) for t in (x_BTSD, f_BTD, post_BTS, res_BTSS))


_mix_out_bwd_op = FusedOp("mhc_mix_out_bwd", mix_out_grads, _mix_out_bwd_fake)


def _mix_out_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def _mix_out_backward(ctx, g_BTSD):  # type: ignore[no-untyped-def]
    return _mix_out_bwd_op(g_BTSD.contiguous(), *ctx.saved_tensors)


_mix_out_op.register_autograd(_mix_out_backward, setup_context=_mix_out_setup)


def mix_out(x_BTSD: Tensor, f_BTD: Tensor, h_post_BTS: Tensor, h_res_BTSS: Tensor) -> Tensor:
    """Fused y_k = H_post[k] F + sum_j H_res[j, k] x_j -> [B,T,S,D], accumulated in fp32."""
    check_inputs(x_BTSD, f_BTD)
    return _mix_out_op(
        x_BTSD.contiguous(),
        f_BTD.contiguous(),
        h_post_BTS.float().contiguous(),
        h_res_BTSS.float().contiguous(),
    )
