"""The engine's one-row matmul as a fused forward-only custom op (`birkhoff::gemv`).

Legend: N output features, K input features.

`engine.linear.linear` calls `gemv` where fused kernels apply (`kernels.use_fused`) and the
activation is a single row (a batch-1 decode step, the MTP depth's catch-up of one position):
y = x W^T + b like F.linear, accumulated in fp32 and rounded once (cuBLAS also accumulates in
fp32; the sums' order differs). Other row counts stay with cuBLAS: from three rows on its
kernels were as fast or faster on the H200 (docs/results.md). Launch: BN output features a
program, K in BK-wide tiles (`CONFIG`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import gemv_triton as G
from birkhoff.kernels.mhc_mix import check_inputs, pow2

CONFIG = dict(BN=4, BK=1024, num_warps=2)  # an H200 sweep at batch 1 (docs/results.md)


@torch.library.custom_op("birkhoff::gemv", mutates_args=())
def gemv(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight^T + bias for x of one row ([..., K] with one row in all), weight [N, K] with
    contiguous rows, bias [N] or None; the result [..., N] in x's dtype."""
    check_inputs(x, weight, *(() if bias is None else (bias,)))
    N, K = weight.shape
    if x.numel() != K or x.shape[-1] != K:
        raise ValueError(f"gemv: x of shape {tuple(x.shape)} is not one row of {K} features")
    if weight.stride(1) != 1:
        raise ValueError(f"gemv: weight rows must be contiguous, strides {weight.stride()}")
    y = x.new_empty((*x.shape[:-1], N))
    bn, bk = CONFIG["BN"], min(CONFIG["BK"], max(16, pow2(K)))
    G.gemv[(-(-N // bn),)](
        x.contiguous(), weight, weight if bias is None else bias, y, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, BN=bn, BK=bk, num_warps=CONFIG["num_warps"],
    )  # fmt: skip
    return y


@gemv.register_fake
def _(x, weight, bias):  # type: ignore[no-untyped-def]
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
