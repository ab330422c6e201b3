"""Block-scaled fp8 (e4m3) for matmul weights: one fp32 scale per 128x128 block.

`q` is `torch.float8_e4m3fn` with the weight's shape and `scale_inv` is fp32 of shape
[ceil(r/block), ceil(c/block)] = amax(|w| over the block) / 448; dequantization is
`q * scale_inv` blockwise. A stack [E, r, c] (an MoE layer's experts) gets blocks per matrix.
On CUDA with Triton the fused kernel of kernels/fp8_quantize.py reproduces the eager reference
bit for bit; elsewhere the reference runs vectorised over blocks with no host sync. The error
bound the tests check (about amax / 16 per block), idempotence and the edge cases are derived
in docs/engine.md.
Left out: per-tensor or per-row scaling, e5m2, stochastic rounding, activation quantization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from birkhoff.kernels import fp8_quantize
from birkhoff.kernels.fp8_quantize import AMAX_FLOOR as _AMAX_FLOOR
from birkhoff.kernels.fp8_quantize import FP8_BLOCK as FP8_BLOCK
from birkhoff.kernels.fp8_quantize import FP8_DTYPE, FP8_MAX

SCALE_SUFFIX = "_scale_inv"  # a quantized weight `name` travels with `name + SCALE_SUFFIX`


def scale_shape(shape: tuple[int, ...] | torch.Size, block: int = 128) -> tuple[int, ...]:
    """Shape of the `scale_inv` tensor for a weight of `shape` ([r, c] or a stack [E, r, c])."""
    *stack, rows, cols = shape
    return (*stack, -(-rows // block), -(-cols // block))


def _check_2d(w: Tensor, block: int, what: str) -> None:
    if w.dim() not in (2, 3):
        raise ValueError(f"{what} must be 2-D (or a 3-D stack of 2-D), got shape {tuple(w.shape)}")
    if block < 1:
        raise ValueError(f"block={block!r} is invalid: must be >= 1")


def _as_blocks(x_rc: Tensor, block: int) -> Tensor:
    """Zero-pad a [r, c] tensor to multiples of `block`; view it as [R, block, C, block]."""
    rows, cols = x_rc.shape
    num_r, num_c = scale_shape((rows, cols), block)
    pad_r, pad_c = num_r * block - rows, num_c * block - cols
    if pad_r or pad_c:
        x_rc = F.pad(x_rc, (0, pad_c, 0, pad_r))
    return x_rc.reshape(num_r, block, num_c, block)


def quantize_fp8_blockwise(
    w: Tensor, block: int = 128, *, out: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """(q float8_e4m3fn [r, c], scale_inv float32 [ceil(r/block), ceil(c/block)]) of a 2-D `w`;
    of a stack [E, r, c]: q [E, r, c], scale_inv [E, ceil(r/block), ceil(c/block)].

    The fused CUDA kernel where it applies, else the eager reference; the same bits either way.
    `out`: contiguous (q, scale_inv) tensors on w's device to write into (and return).
    """
    _check_2d(w, block, "w")
    if out is not None:
        _check_out(w, block, out)
    if w.dim() == 3:
        return _quantize_stack(w, block, out)
    if fp8_quantize.supported(w, block):
        return fp8_quantize.quantize_fp8_blockwise_triton(
            w, block, amax_floor=_AMAX_FLOOR, inv_max=1.0 / FP8_MAX, out=out
        )
    q, scale_inv = quantize_fp8_blockwise_eager(w, block)
    if out is None:
        return q, scale_inv
    out[0].copy_(q)
    out[1].copy_(scale_inv)
    return out


def _quantize_stack(
    w_Erc: Tensor, block: int, out: tuple[Tensor, Tensor] | None
) -> tuple[Tensor, Tensor]:
    """Every matrix of a stack with its own blocks: one [E*r, c] call when r % block == 0."""
    E, rows, cols = w_Erc.shape
    if out is None:
        q = torch.empty(w_Erc.shape, dtype=FP8_DTYPE, device=w_Erc.device)
        out = (q, torch.empty(scale_shape(w_Erc.shape, block), device=w_Erc.device))
    if rows % block == 0:
        # the same blocks as the stack's (none straddles two matrices): [E*r, c], scales [E*R, C]
        flat = (out[0].view(E * rows, cols), out[1].view(-1, out[1].shape[-1]))
        quantize_fp8_blockwise(w_Erc.reshape(E * rows, cols), block, out=flat)
        return out
    for e in range(E):
        quantize_fp8_blockwise(w_Erc[e], block, out=(out[0][e], out[1][e]))
    return out


def _check_out(w: Tensor, block: int, out: tuple[Tensor, Tensor]) -> None:
    q, scale_inv = out
    want = ((tuple(w.shape), FP8_DTYPE), (scale_shape(w.shape, block), torch.float32))
    for what, t, (shape, dtype) in zip(("q", "scale_inv"), out, want, strict=True):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            got = f"{t.dtype}{list(t.shape)}, contiguous={t.is_contiguous()}"
            raise ValueError(f"out {what}: expected contiguous {dtype}{list(shape)}, got {got}")
        if t.device != w.device:
            raise ValueError(f"out {what} is on {t.device}, w on {w.device}")


def quantize_fp8_blockwise_eager(w: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """The reference implementation of `quantize_fp8_blockwise` (any device, plain torch ops)."""
    _check_2d(w, block, "w")
    assert w.dim() == 2, "a stack goes through quantize_fp8_blockwise"
    rows, cols = w.shape
    w_blocks = _as_blocks(w.float(), block)  # [R, b, C, b]
    # max(amax, -amin): two reads of w, no |w| temporary
    amax_blocks = torch.maximum(w_blocks.amax(dim=(1, 3)), -w_blocks.amin(dim=(1, 3)))
    # multiplies, not divisions: CUDA turns division by a Python scalar into a multiply by its
    # reciprocal, so only this form gives the same scales (and codes) on CPU and CUDA
    scale_inv_blocks = amax_blocks.clamp_min(_AMAX_FLOOR) * (1.0 / FP8_MAX)
    # |w| / scale_inv <= 448 up to a few fp32 ulps, and the float -> e4m3fn cast rounds anything
    # below 480 to at most 448 (only >= 480 would become NaN): no clamp pass needed
    q_blocks = (w_blocks * scale_inv_blocks.reciprocal()[:, None, :, None]).to(FP8_DTYPE)
    q = q_blocks.view(q_blocks.shape[0] * block, -1)[:rows, :cols]
    if not q.is_contiguous():
        q = q.contiguous()
    return q, scale_inv_blocks


def quantize_parts(
    parts: list[Tensor], device: torch.device, *, out: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """Quantize the dim-0 concatenation of `parts` (fused q/k/v or gate/up; a single expert
    stack) on `device`.

    The parts are concatenated first: a 128x128 block may straddle their boundary.
    """
    parts = [p.to(device, non_blocking=True) for p in parts]
    weight = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return quantize_fp8_blockwise(weight, out=out)


def dequantize_fp8_blockwise(
    q: Tensor, scale_inv: Tensor, block: int = 128, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Inverse of `quantize_fp8_blockwise`: `q * scale_inv` per block, returned as `dtype`
    (a stack [E, r, c] matrix by matrix, batched)."""
    _check_2d(q, block, "q")
    expected = scale_shape(q.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match q shape {tuple(q.shape)} "
            f"with block={block}: expected {expected}"
        )
    *stack, rows, cols = q.shape
    num_r, num_c = scale_shape((rows, cols), block)
    # X: the matrices of the stack (1 for a 2-D weight); zero-pad to whole blocks
    q_Xrc = F.pad(
        q.reshape(-1, rows, cols).float(), (0, num_c * block - cols, 0, num_r * block - rows)
    )
    q_XRbCb = q_Xrc.view(-1, num_r, block, num_c, block)
    w_XRbCb = q_XRbCb * scale_inv.float().reshape(-1, num_r, 1, num_c, 1)
    w_Xrc = w_XRbCb.view(-1, num_r * block, num_c * block)[:, :rows, :cols]
    return w_Xrc.reshape(*stack, rows, cols).to(dtype)
