"""The engine's few-row matmul as a fused forward-only custom op (`birkhoff::gemv`).

Legend: R activation rows (RB: padded to a power of two), N output features, K input features.

y = x W^T (+ b) for 1 to MAX_ROWS rows, accumulated in fp32 and rounded once: a stream over W
in [BN, BK] tiles without tensor cores (a few rows have nothing to reuse a weight for; the rows
share each weight tile, so a verify or draft chunk of 2-8 rows costs about one row's bytes).
`engine.linear.linear` calls it where `serves(R, N, K)`; other shapes stay with cuBLAS.
Block-fp8 weights (quantize="fp8") are decoded in registers from their e4m3 codes and block
scales (no activation quantization). Launch: BN output features a program (`CONFIG`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import check_inputs, pow2, tl, triton


@triton.jit
def gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    s_ptr,
    y_ptr,
    R,
    N,
    K,
    stride_w,
    stride_s,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,
    SB: tl.constexpr,
    RB: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """SCALED: W is e4m3 codes, one fp32 scale per [SB, SB] block; BN divides SB, so a program's
    rows share one row of blocks and a K tile's scales are one [BK] vector, multiplied onto x
    (RB x BK products, not BN x BK; a scale loaded per weight, or one per SB-wide run with its
    own sum, was slower). One row of codes is summed as a [BN, BK] product, in the layout the
    codes load in (16 codes a thread: 16-byte loads, converted by cvt.e4m3x2 pairs), so only
    the small x tile changes layout."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    r = tl.arange(0, RB)
    n_ok, r_ok = n < N, r < R
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_w
    scales = s_ptr + ((tl.program_id(0) * BN) // SB).to(tl.int64) * stride_s
    acc = tl.zeros([RB, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        x = tl.load(
            x_ptr + r[:, None] * K + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0
        )  # [RB, BK]
        w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SCALED:  # W = code * its block's scale: the scale goes onto x ([RB, BK], not [BN, BK])
            xs = x.to(tl.float32) * tl.load(scales + k // SB, mask=k_ok, other=0.0)[None, :]
            if RB == 1:  # the [BN, BK] form: products in the codes' load layout (16-byte loads)
                acc += tl.sum(xs * w.to(tl.float32), axis=1)[None, :]
            else:
                acc += tl.sum(xs[:, None, :] * w[None, :, :].to(tl.float32), axis=2)
        else:
            # as an [RB, BN, BK] product: its layout gives each thread a contiguous run of K (wide
            # loads; the [BN, BK] form of the one-row sum was slower: docs/log/kernels.md)
            acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n[None, :], mask=n_ok[None, :], other=0.0).to(tl.float32)
    out = y_ptr + r[:, None] * N + n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


MAX_ROWS = 8  # a batch-1 verify chunk (J + 1 rows) or draft depth (J + k rows) up to J = 4
# 2-MAX_ROWS rows: the largest W served (N * K); beyond it cuBLAS is faster (docs/log/kernels.md)
FEW_ROWS_WEIGHTS = 1 << 22
# one row, 2-4 rows of a W with N <= K, 2-4 rows with N > K ("wide": K is short, so narrower K
# tiles and as many programs as one row's config), 5 to MAX_ROWS rows ("many": a narrower K
# tile keeps the [RB, BN, BK] product in registers); block-fp8 codes
# have their own: a byte a weight, so wider K tiles and more rows a program for the same
# 16-byte loads (one row: 128 codes a thread in flight, 72 registers, no spills at sm_90).
# "one" and "few" come from sweeps (docs/log/kernels.md); "wide" and "many" are first picks.
CONFIG = {
    "one": dict(BN=4, BK=1024, num_warps=2),
    "few": dict(BN=2, BK=512, num_warps=2),
    "wide": dict(BN=4, BK=256, num_warps=2),
    "many": dict(BN=4, BK=256, num_warps=4),
    "one_fp8": dict(BN=8, BK=2048, num_warps=4),
    "few_fp8": dict(BN=2, BK=512, num_warps=2),
    "wide_fp8": dict(BN=8, BK=256, num_warps=4),
    "many_fp8": dict(BN=4, BK=256, num_warps=4),
}


def serves(rows: int, N: int, K: int) -> bool:
    """Whether `gemv` is the faster matmul for `rows` rows of W [N, K] (module docstring), bf16
    or block-fp8 (whose other matmul is `kernels.fp8_matmul.fp8_linear`)."""
    return rows == 1 or (2 <= rows <= MAX_ROWS and N * K <= FEW_ROWS_WEIGHTS)


def config(rows: int, N: int, K: int, fp8: bool) -> dict[str, int]:
    """The launch configuration (`CONFIG`) for `rows` rows of W [N, K]."""
    if rows == 1:
        name = "one"
    elif rows > 4:
        name = "many"
    else:
        name = "wide" if N > K else "few"
    return CONFIG[name + ("_fp8" if fp8 else "")]


@torch.library.custom_op("birkhoff::gemv", mutates_args=())
def gemv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    scale_inv: Tensor | None = None,
    block: int = 128,
) -> Tensor:
    """x @ weight^T + bias for x of 1 to MAX_ROWS rows ([..., K]), weight [N, K] with contiguous
    rows, bias [N] or None; the result [..., N] in x's dtype. `scale_inv`: weight holds block-fp8
    codes (float8_e4m3fn) and this is their fp32 scale per `block` x `block` block
    ([ceil(N / block), ceil(K / block)], `engine.fp8.quantize_fp8_blockwise`'s layout):
    W = codes * scale, decoded in the kernel, one byte of W read per weight."""
    fp8 = weight.dtype == torch.float8_e4m3fn
    check_inputs(x, *(t for t in (bias, scale_inv) if t is not None), *(() if fp8 else (weight,)))
    if weight.device != x.device:
        raise ValueError(f"gemv: weight on {weight.device}, x on {x.device}")
    N, K = weight.shape
    rows = x.numel() // max(K, 1)
    if x.shape[-1] != K or not 1 <= rows <= MAX_ROWS:
        raise ValueError(
            f"gemv: x of shape {tuple(x.shape)} is not 1 to {MAX_ROWS} rows of {K} features"
        )
    if weight.stride(1) != 1:
        raise ValueError(f"gemv: weight rows must be contiguous, strides {weight.stride()}")
    if fp8 != (scale_inv is not None):
        raise ValueError(
            f"gemv: a {weight.dtype} weight with scale_inv "
            f"{'given' if scale_inv is not None else 'missing'}: block-fp8 codes "
            "(float8_e4m3fn) take their scales, other weights none"
        )
    blocks = (-(-N // block), -(-K // block))
    if scale_inv is not None and (
        tuple(scale_inv.shape) != blocks or scale_inv.dtype != torch.float32
    ):
        raise ValueError(
            f"gemv: scale_inv {tuple(scale_inv.shape)} {scale_inv.dtype} for a "
            f"[{N}, {K}] fp8 weight, expected {blocks} float32"
        )
    cfg = config(rows, N, K, fp8)
    bn, bk = cfg["BN"], min(cfg["BK"], max(16, pow2(K)))
    if fp8 and (block % bn or block & (block - 1)):
        raise ValueError(f"gemv: fp8 block {block} must be a power of two that BN {bn} divides")
    y = x.new_empty((*x.shape[:-1], N))
    s = weight if scale_inv is None else scale_inv.contiguous()  # unread without scales
    gemv_kernel[(-(-N // bn),)](
        x.contiguous(),
        weight,
        weight if bias is None else bias,
        s,
        y,
        rows,
        N,
        K,
        weight.stride(0),
        s.stride(0),
        HAS_BIAS=bias is not None,
        SCALED=fp8,
        SB=block,
        RB=pow2(rows),
        BN=bn,
        BK=bk,
        num_warps=cfg["num_warps"],
    )
    return y


@gemv.register_fake
def _(x, weight, bias, scale_inv=None, block=128):  # type: ignore[no-untyped-def]
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
