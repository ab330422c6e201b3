"""Triton kernels of the fused stream mixes: mix in, mix out (forward and backward).

Legend: N tokens (B*T flattened), S streams, D model dim; ND = number of D blocks.

Every kernel works on a [BN tokens, BD columns] tile of every stream (grid: token blocks x D
blocks), so one program streams S tiles of 2-D shape, all in one register layout (no 3-D
broadcasts, no layout conversions), and the grid has thousands of programs at training shapes.
The stream loops are `tl.static_range(S)` (unrolled). Sums over streams accumulate in fp32.
- `mix_in_fwd`: y = sum_j h[j] x_j.
- `mix_in_bwd`: g_x_j = h[j] g_y; g_h[j] = <g_y, x_j> as one partial per D block.
- `mix_out_fwd`: y_k = sum_j h_res[j, k] x_j + h_post[k] f.
- `mix_out_proj` (the engine's): mix_out_fwd plus the next sublayer's coefficient projection of
  the new streams, as partials per D block (no second pass over the streams).
- `mix_out_bwd`: g_f = sum_k h_post[k] g_y_k, g_x_j = sum_k h_res[j, k] g_y_k, and partials per
  D block of g_h_post[k] = <g_y_k, f> and g_h_res[j, k] = <x_j, g_y_k>.
The reductions over D end inside a program (a [BN] sum of a [BN, BD] tile, within a warp for
the default tiles) and the ND partials are summed by the caller in a fixed order: deterministic,
no atomics. In mix out the inner stream loops reload a tile they have already read (x_j per k,
g_y_k per j); those reloads hit L1, so each tensor still crosses HBM once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(N, D, BN: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    n_ok = n < N
    return n.to(tl.int64), n_ok, d, n_ok[:, None] & (d < D)[None, :]


@triton.jit
def mix_in_fwd(
    x_ptr, h_ptr, y_ptr, N, D, S: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr
):  # fmt: skip
    n64, n_ok, d, ok = _tile(N, D, BN, BD)
    row = n64[:, None] * (S * D) + d[None, :]
    y = tl.zeros([BN, BD], dtype=tl.float32)
    for j in tl.static_range(S):
        h = tl.load(h_ptr + n64 * S + j, mask=n_ok, other=0.0)
        y += h[:, None] * tl.load(x_ptr + row + j * D, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n64[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def mix_in_bwd(
    gy_ptr, x_ptr, h_ptr, gx_ptr, gh_ptr, N, D,
    S: tl.constexpr, WRITE_GX: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """gh_ptr: [ND, N, S] partials; g_x only if WRITE_GX (else the coefficient backward adds
    h g_y to its own g_x)."""
    n64, n_ok, d, ok = _tile(N, D, BN, BD)
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
def _mix_out_stream(x_ptr, f, post_ptr, res_ptr, y_ptr, n64, n_ok, row, ok, k, S, D, BN, BD):
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
    x_ptr, f_ptr, post_ptr, res_ptr, y_ptr, N, D,
    S: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    n64, n_ok, d, ok = _tile(N, D, BN, BD)
    row = n64[:, None] * (S * D) + d[None, :]
    f = tl.load(f_ptr + n64[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    for k in tl.static_range(S):
        _mix_out_stream(x_ptr, f, post_ptr, res_ptr, y_ptr, n64, n_ok, row, ok, k, S, D, BN, BD)


@triton.jit
def mix_out_proj(
    x_ptr, f_ptr, post_ptr, res_ptr, y_ptr, phit_ptr, part_ptr, sq_ptr, N, D,
    S: tl.constexpr, PP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """mix_out_fwd's arithmetic, and over the new streams as stored, the next sublayer's
    coefficient projection on this tile's S*BD columns: part [ND, N, PP] (y @ phi^T with exact
    fp32 products, fp32 phit [C, PP]) and sq [ND, N] (sum of squares), coeff_proj's partials
    with the D blocks as splits. Narrow tiles (BD 16): the dots stay few registers, and
    decode's few tokens still get ~D / 16 programs."""
    n64, n_ok, d, ok = _tile(N, D, BN, BD)
    row = n64[:, None] * (S * D) + d[None, :]
    f = tl.load(f_ptr + n64[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    p = tl.arange(0, PP)
    sq = tl.zeros([BN], dtype=tl.float32)
    raw = tl.zeros([BN, PP], dtype=tl.float32)
    for k in tl.static_range(S):
        yv = _mix_out_stream(
            x_ptr, f, post_ptr, res_ptr, y_ptr, n64, n_ok, row, ok, k, S, D, BN, BD
        )  # zero outside the tile: every load there reads 0
        sq += tl.sum(yv * yv, axis=1)
        phi_t = tl.load(phit_ptr + (k * D + d)[:, None] * PP + p[None, :],
                        mask=(d < D)[:, None], other=0.0)  # fmt: skip
        raw = tl.dot(yv, phi_t, raw, input_precision="ieee")
    split = tl.program_id(1).to(tl.int64) * N + n64
    tl.store(part_ptr + split[:, None] * PP + p[None, :], raw, mask=n_ok[:, None])
    tl.store(sq_ptr + split, sq, mask=n_ok)


@triton.jit
def mix_out_bwd(
    gy_ptr, x_ptr, f_ptr, post_ptr, res_ptr, gx_ptr, gf_ptr, gpost_ptr, gres_ptr, N, D,
    S: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """gpost_ptr: [ND, N, S] and gres_ptr: [ND, N, S, S] partials."""
    n64, n_ok, d, ok = _tile(N, D, BN, BD)
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
