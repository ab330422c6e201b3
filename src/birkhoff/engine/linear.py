"""The one matmul of the engine: `linear(x, weights, name, bias=None)`.

Every projection reads its weight from the engine's weight dict by name, so replacing the dict
(a commit) swaps all weights at once. When `name + "_scale_inv"` is present the weight is block
fp8: where Triton has fp8 dots (Hopper, or the Triton interpreter) `fp8_matmul.fp8_linear` reads
its codes (up to a few hundred rows widened in registers and multiplied with the activation as
it is, above that fp8 x fp8 after quantizing the activation); elsewhere (CPU: the reference) it
is dequantized to the activation dtype first. With fused kernels on, a matmul of a few
activation rows is `kernels.gemv` where `gemv.serves` says it is faster (one row: batch-1
decode; 2-4 rows of the output and down projections: verify and draft passes), as cuBLAS's tiles
left most of the GPU idle there; a block-fp8 weight goes there on the same rule, decoded from
its codes in the kernel (one byte a weight read, the activation as it is). Left out: caching the
dequantized weights between calls. `weight` is the lookup with dequantization for callers that
do their own matmuls (the stacked experts of engine/moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from birkhoff.engine.fp8 import FP8_BLOCK, SCALE_SUFFIX, dequantize_fp8_blockwise
from birkhoff.kernels import fp8_matmul, use_fused


def weight(weights: dict[str, Tensor], name: str, dtype: torch.dtype) -> Tensor:
    """weights[name], dequantized to `dtype` if it has a block scale (as is otherwise)."""
    w = weights[name]
    scale_inv = weights.get(name + SCALE_SUFFIX)
    if scale_inv is not None:
        w = dequantize_fp8_blockwise(w, scale_inv, block=FP8_BLOCK, dtype=dtype)
    return w


def linear(
    x: Tensor, weights: dict[str, Tensor], name: str, *, bias: str | None = None,
    kernels: str = "eager",
) -> Tensor:  # fmt: skip
    """x @ W^T (+ b) with W = weights[name] (block fp8 if it has a scale: fp8 matmul or
    dequantized) and b = weights[bias] when a bias name is given (biases are never quantized).
    `kernels` (`birkhoff.kernels.use_fused`): a few rows may go to the fused `kernels.gemv`."""
    w = weights[name]
    b = None if bias is None else weights[bias]
    scale_inv = weights.get(name + SCALE_SUFFIX)
    if use_fused(x, kernels) and w.stride(-1) == 1:
        from birkhoff.kernels import gemv

        if gemv.serves(x.numel() // x.shape[-1], *w.shape):
            return gemv.gemv(x, w, b, scale_inv, FP8_BLOCK)  # type: ignore[no-any-return]
    if scale_inv is None:
        return F.linear(x, w, b)
    if fp8_matmul.supported(x):
        out = fp8_matmul.fp8_linear(x, w, scale_inv)
        return out if b is None else out + b
    return F.linear(x, weight(weights, name, x.dtype), b)
