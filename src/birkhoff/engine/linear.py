"""The one matmul of the engine: `linear(x, lin)` for a `Linear` weight record.

A block-fp8 weight (its record has `scale_inv`) goes through `fp8_matmul.fp8_linear` where Triton
has fp8 dots (Hopper, or the Triton interpreter), else it is dequantized to the activation dtype
first (CPU: the reference). With fused kernels on, a matmul of a few activation rows is
`kernels.gemv` where `gemv.serves` says it is faster (batch-1 decode, verify and draft passes),
fp8 codes decoded in the kernel. `weight` is the dequantized lookup for callers that do their own
matmuls (the stacked experts of engine/moe.py). Left out: caching dequantized weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from birkhoff.engine.fp8 import FP8_BLOCK, dequantize_fp8_blockwise
from birkhoff.engine.layout import Linear
from birkhoff.kernels import fp8_matmul, gemv, use_fused


def weight(lin: Linear[Tensor], dtype: torch.dtype) -> Tensor:
    """The record's weight, dequantized to `dtype` if it has a block scale (as is otherwise)."""
    if lin.scale_inv is None:
        return lin.weight
    return dequantize_fp8_blockwise(lin.weight, lin.scale_inv, block=FP8_BLOCK, dtype=dtype)


def linear(x: Tensor, lin: Linear[Tensor], *, kernels: str = "eager") -> Tensor:
    """x @ W^T (+ b) of a weight record (block fp8 if it has a scale: fp8 matmul or dequantized;
    biases are never quantized). `kernels` (`birkhoff.kernels.use_fused`): a few rows may go to
    the fused `kernels.gemv`."""
    w, b, scale_inv = lin.weight, lin.bias, lin.scale_inv
    rows = x.numel() // x.shape[-1]
    if use_fused(x, kernels) and w.stride(-1) == 1 and gemv.serves(rows, *w.shape):
        return gemv.gemv(x, w, b, scale_inv, FP8_BLOCK)  # type: ignore[no-any-return]
    if scale_inv is None:
        return F.linear(x, w, b)
    if fp8_matmul.supported(x):
        out = fp8_matmul.fp8_linear(x, w, scale_inv)
        return out if b is None else out + b
    return F.linear(x, weight(lin, x.dtype), b)
