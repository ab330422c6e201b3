"""Triton kernels of the engine's per-token ops: RMSNorm and rotary embedding (forward only).

Legend: N rows (every leading dim flattened), D normalised dim, H heads, K head dim.

Each replaces a chain of eager elementwise kernels (RMSNorm: upcast, square, mean, rsqrt, two
multiplies, downcast; rope: upcast of x, cos and sin, four multiplies, two adds, a cat, a
downcast) with one launch that reads its input once and writes its output once, computing in
fp32 as the eager functions do. At decode sizes these ops move a few kilobytes, so what they
cost is the number of launches, not bytes.
- `rms_norm_fwd`: [BN rows, BD >= D] tiles; y = x * rsqrt(mean(x^2) + eps) * w.
- `rope_fwd`: one program per (row, head block); the 'half' layout (x[:K/2], x[K/2:]) rotated by
  the row's angles, cos/sin read in their stored dtype (fp64 tables) and used in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd(
    x_ptr, w_ptr, y_ptr, N, D, stride_x, eps,
    HAS_W: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    d = tl.arange(0, BD)
    ok = (n < N)[:, None] & (d < D)[None, :]
    n64 = n.to(tl.int64)
    x = tl.load(x_ptr + n64[:, None] * stride_x + d[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + n64[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rope_fwd(
    x_ptr, cos_ptr, sin_ptr, y_ptr, H, K2, stride_row, stride_head,
    BH: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    k = tl.arange(0, BK)
    ok = (h < H)[:, None] & (k < K2)[None, :]
    cos = tl.load(cos_ptr + row * K2 + k, mask=k < K2, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + row * K2 + k, mask=k < K2, other=0.0).to(tl.float32)[None, :]
    src = x_ptr + row * stride_row + h[:, None] * stride_head + k[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + K2, mask=ok, other=0.0).to(tl.float32)
    dst = y_ptr + row * (H * 2 * K2) + h[:, None] * (2 * K2) + k[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + K2, (x2 * cos + x1 * sin).to(y_ptr.dtype.element_ty), mask=ok)
