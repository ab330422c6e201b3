"""Fused GPU ops (Triton), grouped by op: the one entry point that model and engine call.

Each op's module holds its Triton kernels, its custom-op (and, for training ops, autograd)
wrapper and its input checks; the eager functions in `birkhoff.model` and `birkhoff.engine`
stay the reference and the CPU path. `use_fused(x, kernels)` is the switch every dispatching
function reads. Triton is optional (`common`: a stand-in keeps these imports working without
it). Importing this package registers every op (`birkhoff::*`).
"""

from birkhoff.kernels import (
    accept,
    attention,
    fp8_matmul,
    fp8_quantize,
    gemv,
    mhc,
    moe_gemv,
    norm_rope,
    rng,
    sample,
    step_inputs,
)
from birkhoff.kernels.common import KERNELS, TRITON, needs_grad, use_fused

__all__ = [
    "KERNELS",
    "TRITON",
    "accept",
    "attention",
    "fp8_matmul",
    "fp8_quantize",
    "gemv",
    "mhc",
    "moe_gemv",
    "needs_grad",
    "norm_rope",
    "rng",
    "sample",
    "step_inputs",
    "use_fused",
]
