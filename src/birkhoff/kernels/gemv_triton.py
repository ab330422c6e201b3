"""Triton kernel of the engine's few-row matmul: y = x W^T (+ b) for 1 to MAX_ROWS activation rows.

Legend: R activation rows (RB: R padded to a power of two), N output features, K input features;
W [N, K] row-major (nn.Linear's layout).

`gemv`: each program owns BN output features and reads their BN rows of W in [BN, BK] tiles
(contiguous along K: coalesced), multiplies them by the matching [RB, BK] tile of x and sums
along K in fp32, then adds the bias and rounds once to y's dtype. No tensor cores: a few rows
have next to nothing to reuse a weight for, so the kernel is a stream over W, and small BN
spreads that stream over many programs (N / BN). SCALED: W holds block-fp8 codes (e4m3, one
fp32 scale per [SB, SB] block, the engine's quantize="fp8" layout), decoded in registers, so the
stream is one byte a weight; the activation stays as given (no activation quantization: at a
few rows there is no tensor-core product to feed). At batch 1 cuBLAS's kernels took 4-7.5 us a
projection on the h200-small shapes streamed from HBM, ~0.5-1.3 TB/s (benchmarks/gemv.py,
docs/results.md).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, R, N, K, stride_w, stride_s,
    HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """SCALED: W is e4m3 codes, one fp32 scale per [SB, SB] block; BN divides SB, so a program's
    rows share one row of blocks and a K tile's scales are one [BK] vector (a scale loaded per
    weight, or one per SB-wide run with its own sum, was slower)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    r = tl.arange(0, RB)
    n_ok, r_ok = n < N, r < R
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    scales = s_ptr + ((tl.program_id(0) * BN) // SB).to(tl.int64) * stride_s
    acc = tl.zeros([RB, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        x = tl.load(x_ptr + r[:, None] * K + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [RB, BK]  # fmt: skip
        w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SCALED:  # weight = code * its block's scale, in fp32
            w = w.to(tl.float32) * tl.load(scales + k // SB, mask=k_ok, other=0.0)[None, :]
        # as an [RB, BN, BK] product: its layout gives each thread a contiguous run of K (wide
        # loads); the [BN, BK] form of the one-row sum ran 1.2-2x slower on the H200
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n[None, :], mask=n_ok[None, :], other=0.0).to(tl.float32)
    out = y_ptr + r[:, None] * N + n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])
