"""The engine's few-row matmul as a fused forward-only custom op (`birkhoff::gemv`).

Legend: R activation rows, N output features, K input features.

`engine.linear.linear` calls `gemv` where fused kernels apply (`kernels.use_fused`) and
`serves(R, N, K)`: one row always (a batch-1 decode step, a draft depth's one-position step),
and 2 to MAX_ROWS rows where N <= K (a verify or draft pass of a few positions through the
output and down projections): y = x W^T + b like F.linear, accumulated in fp32 and rounded once
(cuBLAS also accumulates in fp32; the sums' order differs). Other shapes stay with cuBLAS: on the
H200 its kernels were as fast from two rows on where N > K (the fused qkv and gate/up), and from
MAX_ROWS + 1 rows on (docs/results.md). Launch: BN output features a program, K in BK-wide
tiles (`CONFIG`, per row class).
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import gemv_triton as G
from birkhoff.kernels.mhc_mix import check_inputs, pow2

MAX_ROWS = 4
# H200 sweeps (docs/results.md): one row, and 2 to MAX_ROWS rows
CONFIG = {"one": dict(BN=4, BK=1024, num_warps=2), "few": dict(BN=2, BK=512, num_warps=2)}


def serves(rows: int, N: int, K: int) -> bool:
    """Whether `gemv` is the faster matmul for `rows` rows of W [N, K] (module docstring)."""
    return rows == 1 or (2 <= rows <= MAX_ROWS and N <= K)


@torch.library.custom_op("birkhoff::gemv", mutates_args=())
def gemv(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight^T + bias for x of 1 to MAX_ROWS rows ([..., K]), weight [N, K] with contiguous
    rows, bias [N] or None; the result [..., N] in x's dtype."""
    check_inputs(x, weight, *(() if bias is None else (bias,)))
    N, K = weight.shape
    rows = x.numel() // max(K, 1)
    if x.shape[-1] != K or not 1 <= rows <= MAX_ROWS:
        raise ValueError(
            f"gemv: x of shape {tuple(x.shape)} is not 1 to {MAX_ROWS} rows of {K} features"
        )
    if weight.stride(1) != 1:
        raise ValueError(f"gemv: weight rows must be contiguous, strides {weight.stride()}")
    y = x.new_empty((*x.shape[:-1], N))
    cfg = CONFIG["one" if rows == 1 else "few"]
    bn, bk = cfg["BN"], min(cfg["BK"], max(16, pow2(K)))
    G.gemv[(-(-N // bn),)](
        x.contiguous(), weight, weight if bias is None else bias, y, rows, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, RB=pow2(rows), BN=bn, BK=bk, num_warps=cfg["num_warps"],
    )  # fmt: skip
    return y


@gemv.register_fake
def _(x, weight, bias):  # type: ignore[no-untyped-def]
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
