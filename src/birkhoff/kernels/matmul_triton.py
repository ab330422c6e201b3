"""Triton kernel of the engine's tiled matmul: y = x W^T (+ b), optionally SwiGLU'd.

Legend: M activation rows, N output features, K input features; W [N, K] row-major
(nn.Linear's layout).

`matmul`: each program owns a [BM, BN] tile of y and walks K in BK-wide steps, one tensor-core
dot of an [BM, BK] tile of x and the transposed [BN, BK] tile of W a step, accumulated in
fp32 and rounded once (as cuBLAS does; the sums' order differs). No split of K: each output is
one program's sum, so a row's values do not depend on the other rows of the call.
With SWIGLU, W is the fused [gate | up] projection (N = 2F rows, gate first) and y [M, F] is
silu(gate) * up: the program takes the tile's F columns from both halves (two accumulators),
rounds each to y's dtype as a separate projection would, and applies the same fp32 SwiGLU as
`norm_rope_triton.silu_mul_fwd`, so the bits equal the projection then silu_mul.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot_tile(x_ptr, w_ptr, m, n, M, N, K, stride_x, stride_w, BM: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, EMU: tl.constexpr):  # fmt: skip
    """The fp32 [BM, BN] sum over K of x[m, :] W[n, :]^T (rows past M or N read as zeros).
    EMU: the dot in fp32 of the same values (the Triton interpreter's bf16 dots are wrong)."""
    m_ok, n_ok = m < M, n < N
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if EMU:
            acc = tl.dot(x.to(tl.float32), tl.trans(w).to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def matmul(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """y [M, N] = x W^T (+ b); with SWIGLU, y [M, N // 2] = silu(gate) * up of the halves."""
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    dtype = y_ptr.dtype.element_ty
    if SWIGLU:
        F = N // 2
        gate = _dot_tile(x_ptr, w_ptr, m, n, M, F, K, stride_x, stride_w, BM, BN, BK, EMU)
        up = _dot_tile(x_ptr, w_ptr + F * stride_w, m, n, M, F, K, stride_x, stride_w, BM, BN,
                       BK, EMU)  # fmt: skip
        if HAS_BIAS:
            gate += tl.load(b_ptr + n, mask=n < F, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_ptr + F + n, mask=n < F, other=0.0).to(tl.float32)[None, :]
        g = gate.to(dtype).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * up.to(dtype).to(tl.float32)
        width = F
    else:
        y = _dot_tile(x_ptr, w_ptr, m, n, M, N, K, stride_x, stride_w, BM, BN, BK, EMU)
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        width = N
    ok = (m < M)[:, None] & (n < width)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * width + n[None, :], y.to(dtype), mask=ok)
