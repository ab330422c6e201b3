"""The engine's few-row matmul as a fused forward-only custom op (`birkhoff::gemv`).

Legend: R activation rows, N output features, K input features.

`engine.linear.linear` calls `gemv` where fused kernels apply (`kernels.use_fused`) and
`serves(R, N, K)`: one row always (a batch-1 decode step, a draft depth's one-position step),
and 2 to MAX_ROWS rows where N <= K (a verify or draft pass of a few positions through the
output and down projections): y = x W^T + b like F.linear, accumulated in fp32 and rounded once
(cuBLAS also accumulates in fp32; the sums' order differs). Other shapes stay with cuBLAS: on the
H200 its kernels were as fast from two rows on where N > K (the fused qkv and gate/up), and from
MAX_ROWS + 1 rows on, and for 2-4 rows of a W larger than FEW_ROWS_WEIGHTS (docs/results.md).
Block-fp8 weights (the engine's quantize="fp8") are decoded in the kernel from their e4m3 codes
and block scales (no activation quantization), on the same rule. Launch: BN output features a
program, K in BK-wide tiles (`CONFIG`, per row class).
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import gemv_triton as G
from birkhoff.kernels.mhc_mix import check_inputs, pow2

MAX_ROWS = 4
# 2-4 rows: the largest W served (N * K). Measured on the H200: gemv ahead of cuBLAS and the fp8
# GEMM at 768 x 2048 (1.6M), 1.5-2.3x behind them at 4096 x 4096 (16.8M) and wider; between, not
# measured
FEW_ROWS_WEIGHTS = 1 << 22
# H200 sweeps (docs/results.md): one row, and 2 to MAX_ROWS rows
CONFIG = {"one": dict(BN=4, BK=1024, num_warps=2), "few": dict(BN=2, BK=512, num_warps=2)}


def serves(rows: int, N: int, K: int) -> bool:
    """Whether `gemv` is the faster matmul for `rows` rows of W [N, K] (module docstring), bf16
    or block-fp8 (whose other matmul is `engine.fp8_matmul.fp8_linear`)."""
    return rows == 1 or (2 <= rows <= MAX_ROWS and N <= K and N * K <= FEW_ROWS_WEIGHTS)


@torch.library.custom_op("birkhoff::gemv", mutates_args=())
def gemv(
    x: Tensor, weight: Tensor, bias: Tensor | None, scale_inv: Tensor | None = None,
    block: int = 128,
) -> Tensor:  # fmt: skip
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
        raise ValueError(f"gemv: a {weight.dtype} weight with scale_inv "
                         f"{'given' if scale_inv is not None else 'missing'}: block-fp8 codes "
                         "(float8_e4m3fn) take their scales, other weights none")  # fmt: skip
    blocks = (-(-N // block), -(-K // block))
    if scale_inv is not None and (tuple(scale_inv.shape) != blocks
                                  or scale_inv.dtype != torch.float32):  # fmt: skip
        raise ValueError(f"gemv: scale_inv {tuple(scale_inv.shape)} {scale_inv.dtype} for a "
                         f"[{N}, {K}] fp8 weight, expected {blocks} float32")  # fmt: skip
    cfg = CONFIG["one" if rows == 1 else "few"]
    bn, bk = cfg["BN"], min(cfg["BK"], max(16, pow2(K)))
    if fp8 and (block % bn or block & (block - 1)):
        raise ValueError(f"gemv: fp8 block {block} must be a power of two that BN {bn} divides")
    y = x.new_empty((*x.shape[:-1], N))
    s = weight if scale_inv is None else scale_inv.contiguous()  # unread without scales
    G.gemv[(-(-N // bn),)](
        x.contiguous(), weight, weight if bias is None else bias, s, y, rows, N, K,
        weight.stride(0), s.stride(0), HAS_BIAS=bias is not None, SCALED=fp8, SB=block,
        RB=pow2(rows), BN=bn, BK=bk, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return y


@gemv.register_fake
def _(x, weight, bias, scale_inv=None, block=128):  # type: ignore[no-untyped-def]
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
