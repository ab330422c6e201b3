"""One-pass block-fp8 quantization on CUDA (Triton): read each 128x128 block once, write its codes.

The eager reference (`fp8.quantize_fp8_blockwise_eager`) makes about ten passes over an fp32
weight (pad, two reductions, multiply, cast, slice); this kernel loads a block tile into
registers, reduces |w| to the block's amax, and stores the e4m3 codes and the fp32 `scale_inv`:
one read of the weight, one write of the codes. It reproduces the reference bit for bit (tested
on GPU against the CPU reference): the same fp32 operations in the same order (amax, clamp to
the floor, multiply by the fp32 constant 1/448, IEEE reciprocal, multiply, round-to-nearest
cast), out-of-range elements of an edge block read as 0 like the reference's zero padding, and
a block holding NaN gets a NaN scale like `amax` gives (Triton's max skips NaN).
The cast saturates where torch's would give NaN, but only for |w * recip| >= 480, which the
scaling rules out. Left out: fusing the dim-0 concatenation of q/k/v or gate/up parts (the
caller concatenates), other block sizes than the tile (any power of two works), fp8 e5m2.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

AVAILABLE = importlib.util.find_spec("triton") is not None

if AVAILABLE:
    import triton
    import triton.language as tl

    @triton.jit
    def _quantize_block(
        w_ptr, q_ptr, s_ptr, rows, cols, stride_w, stride_q, num_col_blocks,
        amax_floor, inv_max, BLOCK: tl.constexpr,
    ):  # fmt: skip
        block_r, block_c = tl.program_id(0), tl.program_id(1)
        r = block_r * BLOCK + tl.arange(0, BLOCK)[:, None]
        c = block_c * BLOCK + tl.arange(0, BLOCK)[None, :]
        inside = (r < rows) & (c < cols)
        w = tl.load(w_ptr + r.to(tl.int64) * stride_w + c, mask=inside, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
        scale_inv = tl.maximum(amax, amax_floor) * inv_max
        has_nan = tl.max(tl.max((w != w).to(tl.int32), axis=1), axis=0) > 0
        scale_inv = tl.where(has_nan, float("nan"), scale_inv)
        recip = tl.math.div_rn(tl.full((), 1.0, tl.float32), scale_inv)
        q = (w * recip).to(tl.float8e4nv)
        tl.store(q_ptr + r.to(tl.int64) * stride_q + c, q, mask=inside)
        tl.store(s_ptr + block_r * num_col_blocks + block_c, scale_inv)


def supported(w: Tensor, block: int) -> bool:
    """True if the kernel can quantize `w` (CUDA, Triton present, power-of-two block)."""
    return AVAILABLE and w.is_cuda and block >= 16 and block & (block - 1) == 0


def quantize_fp8_blockwise_triton(
    w: Tensor,
    block: int,
    *,
    amax_floor: float,
    inv_max: float,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(q, scale_inv) of a 2-D CUDA tensor; same contract as the eager reference.

    `out`: contiguous (q, scale_inv) of the right shapes and dtypes (checked by the caller).
    """
    assert supported(w, block), "quantize_fp8_blockwise_triton needs CUDA, Triton, 2^k block"
    if w.stride(1) != 1:
        w = w.contiguous()
    rows, cols = w.shape
    num_r, num_c = -(-rows // block), -(-cols // block)
    if out is None:
        q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
        scale_inv = torch.empty((num_r, num_c), dtype=torch.float32, device=w.device)
    else:
        q, scale_inv = out
    if q.numel():
        _quantize_block[(num_r, num_c)](
            w, q, scale_inv, rows, cols, w.stride(0), q.stride(0), num_c,
            amax_floor, inv_max, BLOCK=block, num_warps=8,
        )  # fmt: skip
    return q, scale_inv
