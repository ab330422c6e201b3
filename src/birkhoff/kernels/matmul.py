"""The engine's tiled matmul as a fused forward-only custom op (`birkhoff::matmul`).

Legend: M activation rows, N output features, K input features, F = N / 2 (SwiGLU).

`matmul(x, W, b, swiglu)` is y = x W^T + b like F.linear, in x's dtype from an fp32 sum; with
`swiglu` it is silu(gate) * up of the fused [gate | up] projection, the same bits as the
projection then `norm_rope.silu_mul` when the projection's bits are the same (one launch and no
[M, 2F] round trip). `engine.linear` calls it for bf16 / fp16 activations of MIN_ROWS to
MAX_ROWS rows (`serves`): there cuBLAS's kernels for the decode step's shapes were slower
(docs/results.md). Launch: [BM, BN] tiles of y by row class (`config`), K in BK-wide steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import matmul_triton as T
from birkhoff.kernels.mhc_mix import cdiv, check_inputs
from birkhoff.kernels.ops import INTERPRET

MIN_ROWS, MAX_ROWS = 5, 256
# H200 sweep (docs/results.md): by the rows a call has, the largest class not above them
CONFIG = {
    5: dict(BM=64, BN=32, BK=64, num_warps=4, num_stages=4),
}


def serves(x: Tensor) -> bool:
    """Whether the tiled matmul is the engine's matmul for activations `x` (module docstring)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return x.dtype in (torch.bfloat16, torch.float16) and MIN_ROWS <= rows <= MAX_ROWS


def config(rows: int) -> dict[str, int]:
    return CONFIG[max(r for r in CONFIG if r <= max(rows, min(CONFIG)))]


def launch(x: Tensor, weight: Tensor, bias: Tensor | None, swiglu: bool,
           cfg: dict[str, int]) -> Tensor:  # fmt: skip
    """The checked launch under an explicit tile config (what `matmul` and the sweep run)."""
    check_inputs(x, weight, *(() if bias is None else (bias,)))
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"matmul: x of shape {tuple(x.shape)} does not have {K} features")
    if weight.stride(1) != 1:
        raise ValueError(f"matmul: weight rows must be contiguous, strides {weight.stride()}")
    if swiglu and N % 2:
        raise ValueError(f"matmul: swiglu needs an even number of weight rows [gate | up], {N}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"matmul: bias of shape {tuple(bias.shape)} is not ({N},)")
    x_MK = x.reshape(-1, K)
    if x_MK.stride(-1) != 1:
        x_MK = x_MK.contiguous()
    M, width = x_MK.shape[0], N // 2 if swiglu else N
    y = x.new_empty((*x.shape[:-1], width))
    if M and width:
        bm, bn = cfg["BM"], cfg["BN"]
        T.matmul[(cdiv(width, bn), cdiv(M, bm))](
            x_MK, weight, weight if bias is None else bias, y, M, N, K, x_MK.stride(0),
            weight.stride(0), HAS_BIAS=bias is not None, SWIGLU=swiglu, BM=bm, BN=bn,
            BK=cfg["BK"], EMU=INTERPRET, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
    return y


@torch.library.custom_op("birkhoff::matmul", mutates_args=())
def matmul(x: Tensor, weight: Tensor, bias: Tensor | None, swiglu: bool = False) -> Tensor:
    """x @ weight^T + bias for x [..., K], weight [N, K] with contiguous rows, bias [N] or
    None; with `swiglu`, silu(gate) * up of its two halves ([..., N / 2]). In x's dtype."""
    return launch(x, weight, bias, swiglu, config(x.numel() // max(x.shape[-1], 1)))


@matmul.register_fake
def _(x, weight, bias, swiglu=False):  # type: ignore[no-untyped-def]
    return x.new_empty((*x.shape[:-1], weight.shape[0] // (2 if swiglu else 1)))
