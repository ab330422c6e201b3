"""Block-scaled fp8 matmuls (DeepSeek-V3's weight layout) as one Triton kernel, two modes.

Legend: N rows of activations, X input features, Y output features, G = ceil(X/128) groups.

y = x W^T with W stored as e4m3 codes plus one fp32 `scale_inv` per 128x128 block. `fp8_linear`
quantizes the activation per row and 128-group and uses fp8 x fp8 dots above
CONFIG["WEIGHT_ONLY_ROWS"] rows, and widens the codes in registers (weight-only) below it.
`fp8_linear_reference` computes either formula from dequantized operands in fp32. Runs where
Triton has fp8 dots: CUDA compute capability >= 8.9 and the Triton interpreter. The formulas and
the choice of modes: docs/engine.md.
Left out: split-K for very small Y, autotuning.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from birkhoff.kernels.common import TRITON, tl, triton
from birkhoff.kernels.fp8_quantize import AMAX_FLOOR, FP8_BLOCK, FP8_DTYPE, FP8_MAX


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def supported(x: Tensor) -> bool:
    """Whether the fp8 kernel runs for activations `x` (else: dequantize, then matmul)."""
    if not TRITON:
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device) >= (8, 9) and not interpreting()
    return interpreting()


def quantize_activation(x_NX: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 codes [N,X], fp32 scales [N,G]): one scale per row and 128-group of X.

    The reference (plain torch ops); `fp8_linear` runs the same math as one kernel."""
    N, X = x_NX.shape
    G = -(-X // FP8_BLOCK)
    x_NGB = torch.nn.functional.pad(x_NX.float(), (0, G * FP8_BLOCK - X)).view(N, G, FP8_BLOCK)
    amax_NG = x_NGB.abs().amax(dim=-1)
    scale_NG = amax_NG.clamp_min(AMAX_FLOOR) * (1.0 / FP8_MAX)
    q_NGB = (x_NGB * scale_NG.reciprocal()[..., None]).to(FP8_DTYPE)
    return q_NGB.view(N, G * FP8_BLOCK)[:, :X], scale_NG


def quantize_activation_cuda(x_NX: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize_activation` as one Triton kernel (bit-identical to it; CUDA only: the Triton
    interpreter rounds float -> e4m3 wrongly at binade boundaries, e.g. -127.4 -> -64)."""
    N, X = x_NX.shape
    G = -(-X // FP8_BLOCK)
    x_NX = x_NX.contiguous()
    qa_NX = torch.empty(N, X, dtype=FP8_DTYPE, device=x_NX.device)
    a_scale_NG = torch.empty(N, G, dtype=torch.float32, device=x_NX.device)
    _quantize_rows[(N, G)](
        x_NX, qa_NX, a_scale_NG, X, G, AMAX_FLOOR, 1.0 / FP8_MAX, BLOCK_X=FP8_BLOCK
    )
    return qa_NX, a_scale_NG


def fp8_linear_reference(
    x: Tensor, q_YX: Tensor, scale_inv: Tensor, *, quantize_input: bool = True
) -> Tensor:
    """The kernel's formula from dequantized operands, in fp32 (the test reference); without
    `quantize_input` the weight-only mode's (the activation as it is)."""
    x_NX = x.reshape(-1, x.shape[-1])
    if quantize_input:
        qa_NX, a_scale_NG = quantize_activation(x_NX)
        a_NX = qa_NX.float() * a_scale_NG.repeat_interleave(FP8_BLOCK, dim=1)[:, : x_NX.shape[1]]
    else:
        a_NX = x_NX.float()
    w_YX = (
        q_YX.float()
        * scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[
            : q_YX.shape[0], : q_YX.shape[1]
        ]
    )
    return (a_NX @ w_YX.t()).to(x.dtype).view(*x.shape[:-1], q_YX.shape[0])


def weight_only(rows: int) -> bool:
    """Whether `fp8_linear` of `rows` activation rows runs the weight-only mode (docstring)."""
    return rows <= CONFIG["WEIGHT_ONLY_ROWS"]


def fp8_linear(
    x: Tensor, q_YX: Tensor, scale_inv: Tensor, *, quantize_input: bool | None = None
) -> Tensor:
    """x @ W^T for block-fp8 W (codes q_YX, scales scale_inv); x's dtype out. `quantize_input`:
    True for fp8 x fp8, False for weight-only, None to choose by row count (`weight_only`)."""
    assert TRITON and q_YX.dtype == FP8_DTYPE, q_YX.dtype
    assert q_YX.is_contiguous() and scale_inv.is_contiguous()
    x_NX = x.reshape(-1, x.shape[-1])
    N, X = x_NX.shape
    Y = q_YX.shape[0]
    if quantize_input is None:
        quantize_input = not weight_only(N)
    if quantize_input:
        quantize = quantize_activation_cuda if x.is_cuda else quantize_activation
        a_NX, a_scale_NG = quantize(x_NX)
    else:  # the activation as it is; a_scale is not read
        a_NX = x_NX if x_NX.stride(-1) == 1 else x_NX.contiguous()
        a_scale_NG = scale_inv
    y_NY = torch.empty(N, Y, dtype=x.dtype, device=x.device)
    block_m = 16 if N <= 16 else 32 if N <= 32 else 64
    block_y = CONFIG["BLOCK_Y_FEW"] if N <= 64 else CONFIG["BLOCK_Y"]
    grid = (triton.cdiv(N, block_m), triton.cdiv(Y, block_y))
    _fp8_gemm[grid](
        a_NX,
        a_scale_NG,
        q_YX,
        scale_inv,
        y_NY,
        N,
        Y,
        X,
        a_NX.stride(0),
        a_scale_NG.stride(0),
        scale_inv.stride(0),
        QUANTIZED_A=quantize_input,
        IEEE=a_NX.dtype == torch.float32 or interpreting(),
        BLOCK_N=block_m,
        BLOCK_Y=block_y,
        BLOCK_X=FP8_BLOCK,
        num_warps=4,
        num_stages=3,
    )
    return y_NY.view(*x.shape[:-1], Y)


# output features a program (dividing FP8_BLOCK), up to 64 activation rows and above: narrow
# tiles give few rows more programs; WEIGHT_ONLY_ROWS: up to how many rows the weight-only mode
# runs (beyond, the bf16 dots cost more than the quantization launch). Measured with
# `python benchmarks/fp8_matmul.py` (docs/log/kernels.md); read at every call
CONFIG = {"BLOCK_Y_FEW": 16, "BLOCK_Y": 32, "WEIGHT_ONLY_ROWS": 64}


@triton.jit
def _fp8_gemm(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    y_ptr,
    N,
    Y,
    X,
    stride_a,
    stride_a_scale,
    stride_w_scale,
    QUANTIZED_A: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Y: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    """One [BLOCK_N, BLOCK_Y] tile of y; one X tile is one 128-group of both scales (BLOCK_Y
    divides the 128-row weight block: one weight scale per tile). QUANTIZED_A: a holds e4m3
    codes with their scales (fp8 x fp8 dots); else a is the activation, the codes are
    widened to its dtype (IEEE: to fp32, multiplied in full fp32: fp32 activations, and all
    in the Triton interpreter, whose bf16 dots are wrong)."""
    pid_n, pid_y = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_y * BLOCK_Y + tl.arange(0, BLOCK_Y)
    xs = tl.arange(0, BLOCK_X)
    row_ok, col_ok = rows < N, cols < Y
    w_scale_row = (pid_y * BLOCK_Y) // BLOCK_X  # BLOCK_Y divides the 128-row scale block
    acc = tl.zeros((BLOCK_N, BLOCK_Y), dtype=tl.float32)
    for g in range(0, tl.cdiv(X, BLOCK_X)):
        x = g * BLOCK_X + xs
        x_ok = x < X
        a = tl.load(
            a_ptr + rows[:, None] * stride_a + x[None, :],
            mask=row_ok[:, None] & x_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :] * X + x[:, None], mask=col_ok[None, :] & x_ok[:, None], other=0.0
        )
        w_scale = tl.load(w_scale_ptr + w_scale_row * stride_w_scale + g)
        if QUANTIZED_A:
            a_scale = tl.load(a_scale_ptr + rows * stride_a_scale + g, mask=row_ok, other=0.0)
            acc += tl.dot(a, w) * (a_scale[:, None] * w_scale)
        elif IEEE:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee") * w_scale
        else:
            acc += tl.dot(a, w.to(a.dtype)) * w_scale
    tl.store(
        y_ptr + rows[:, None] * Y + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _quantize_rows(x_ptr, q_ptr, scale_ptr, X, G, amax_floor, inv_max, BLOCK_X: tl.constexpr):
    """One program per (row, 128-group): amax, scale = amax / 448, codes = x / scale."""
    row, g = tl.program_id(0), tl.program_id(1)
    k = g * BLOCK_X + tl.arange(0, BLOCK_X)
    x = tl.load(x_ptr + row * X + k, mask=k < X, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), amax_floor) * inv_max
    # IEEE reciprocal (Triton's `/` may be approximate) as torch's, for identical codes
    recip = tl.math.div_rn(tl.full((), 1.0, tl.float32), scale)
    q = (x * recip).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * X + k, q, mask=k < X)
    tl.store(scale_ptr + row * G + g, scale)
