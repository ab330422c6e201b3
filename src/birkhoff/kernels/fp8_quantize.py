"""Block-fp8 (e4m3) format constants and the one-pass quantization kernel (CUDA, Triton).

The kernel reads each 128x128 block of a weight once and writes its e4m3 codes and fp32
`scale_inv`, where the eager reference (`engine.fp8.quantize_fp8_blockwise_eager`) makes about
ten passes. It reproduces the reference bit for bit: the same fp32 operations in the same order
(amax, clamp to the floor, multiply by 1/448, IEEE reciprocal, round-to-nearest cast), edge
blocks zero-padded, a NaN block gets a NaN scale. The cast saturates where torch's would give
NaN, only for |w * recip| >= 480, which the scaling rules out. Left out: fusing the q/k/v or
gate/up concatenation, other block sizes than the tile, e5m2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import TRITON, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_BLOCK = 128  # one fp32 scale per FP8_BLOCK x FP8_BLOCK block of a weight
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# smallest amax treated as non-zero: keeps amax / 448 a normal fp32 number
AMAX_FLOOR = torch.finfo(torch.float32).tiny * FP8_MAX


@triton.jit
def _quantize_block(
    w_ptr,
    q_ptr,
    s_ptr,
    rows,
    cols,
    stride_w,
    stride_q,
    num_col_blocks,
    amax_floor,
    inv_max,
    BLOCK: tl.constexpr,
):
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
    return TRITON and w.is_cuda and block >= 16 and block & (block - 1) == 0


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
            w,
            q,
            scale_inv,
            rows,
            cols,
            w.stride(0),
            q.stride(0),
            num_c,
            amax_floor,
            inv_max,
            BLOCK=block,
            num_warps=8,
        )
    return q, scale_inv
