"""The one matmul of the engine: `linear(x, weights, name)`.

Every projection reads its weight from the engine's weight dict by name, so replacing the dict
(a commit) swaps all weights at once. When `name + "_scale_inv"` is present the weight is block
fp8 and is dequantized to the activation dtype first. Left out (v1): torch._scaled_mm on GPU and
caching the dequantized weights between calls.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from birkhoff.engine.fp8 import FP8_BLOCK, SCALE_SUFFIX, dequantize_fp8_blockwise


def linear(x: Tensor, weights: dict[str, Tensor], name: str, *, bias: str | None = None) -> Tensor:
    """x @ W^T (+ b) with W = weights[name] (dequantized if it has a block scale) and
    b = weights[bias] when a bias name is given (biases are never quantized)."""
    w = weights[name]
    scale_inv = weights.get(name + SCALE_SUFFIX)
    if scale_inv is not None:
        w = dequantize_fp8_blockwise(w, scale_inv, block=FP8_BLOCK, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else weights[bias])
