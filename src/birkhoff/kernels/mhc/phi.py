"""The layouts of phi [P, C] that the fused projection kernels read, and the bf16x3 products.

Legend: P coefficient logits, C = S*D, PP: P padded to a power of two (>= 16).

`projection_phi`: phi transposed and zero-padded to [C, PP] (coalesced, unmasked loads), in fp32
or as three bf16 terms hi + mid + lo ([3, C, PP]: 24 significant bits, for exact bf16
tensor-core products with bf16 streams); one launch of `phi_pad_t`. `served_phi`: the engine's
phi as a view of such a buffer, so its decode step launches no transposing copy. `split3` and
`dot_bf16` are the split-precision arithmetic; under the Triton interpreter (EMU), whose bf16
dots are not exact, the products run as fp32 dots of the same values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import cdiv, tl, triton
from birkhoff.kernels.fused_op import traceable
from birkhoff.kernels.mhc.configs import padded_logits


@triton.jit
def dot_bf16(a, b, acc, EMU: tl.constexpr):
    """acc + a @ b for bf16 a and b, accumulated in fp32 (exact products). EMU: as an fp32 dot of
    the same values (the Triton interpreter's bf16 dots are wrong)."""
    if EMU:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def split3(v):
    """fp32 v as three bf16 terms hi + mid + lo (24 significant bits, v's own to rounding)."""
    hi = v.to(tl.bfloat16)
    rest = v - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def phi_pad_t(phi_ptr, out_ptr, P, C, PP: tl.constexpr, BC: tl.constexpr, TERMS: tl.constexpr):
    """out[C, PP] = phi[P, C]^T, zero in the padded columns p >= P (one launch instead of a
    fill and a strided copy): in fp32 (TERMS 1), or as the three bf16 terms of `split3`,
    out [3, C, PP] (TERMS 3)."""
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    p = tl.arange(0, PP)
    ok = (c < C)[:, None] & (p < P)[None, :]
    tile = tl.load(phi_ptr + p[None, :] * C + c[:, None], mask=ok, other=0.0).to(tl.float32)
    out = out_ptr + c[:, None] * PP + p[None, :]
    if TERMS == 3:
        terms = split3(tile)
        for t in tl.static_range(3):
            tl.store(out + t * C * PP, terms[t], mask=(c < C)[:, None])
    else:
        tl.store(out, tile, mask=(c < C)[:, None])


def served_phi(phi_PC: Tensor) -> Tensor:
    """phi [P, C] (same values) as a view of a zero-padded [C, PP] fp32 buffer: the layout the
    fused projection reads, so a call with it launches no transposing copy (the engine's)."""
    (P, C), PP = phi_PC.shape, padded_logits(phi_PC.shape[0])
    return phi_PC.new_zeros((C, PP), dtype=torch.float32)[:, :P].copy_(phi_PC.t()).t()


def is_served(phi_PC: Tensor) -> bool:
    """Whether phi is `served_phi`'s layout: fp32, stride (1, PP), its [C, PP] rows in storage
    (the pad's values never matter: only P projection columns are read). Never when compiling:
    dynamo cannot trace storage queries (and compiled code holds no served phi)."""
    C, PP = phi_PC.shape[1], padded_logits(phi_PC.shape[0])
    if torch.compiler.is_compiling() or phi_PC.dtype != torch.float32:
        return False
    if phi_PC.stride() != (1, PP):  # the trainer's contiguous phi: no storage query
        return False
    return (phi_PC.storage_offset() + C * PP) * 4 <= phi_PC.untyped_storage().nbytes()


def projection_phi(phi_PC: Tensor, terms: int) -> Tensor:
    """phi transposed and zero-padded: [C, PP] fp32 (terms 1; a view of a served phi) or its
    three bf16 terms [3, C, PP] (terms 3)."""
    (P, C), PP, BC = phi_PC.shape, padded_logits(phi_PC.shape[0]), 64
    if terms == 1 and is_served(phi_PC):
        return phi_PC.as_strided((C, PP), (PP, 1))
    if terms == 1:
        out = phi_PC.new_empty((C, PP), dtype=torch.float32)
    else:
        out = phi_PC.new_empty((3, C, PP), dtype=torch.bfloat16)
    traceable(phi_pad_t)[(cdiv(C, BC),)](phi_PC.contiguous(), out, P, C, PP=PP, BC=BC, TERMS=terms)
    return out
