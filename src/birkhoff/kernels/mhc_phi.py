"""The layouts of phi [P, C] that the fused projection kernels read.

Legend: P coefficient logits, C = S*D, PP: P padded to a power of two (>= 16).

- `projection_phi`: phi transposed and zero-padded to [C, PP], so the kernels' loads are
  coalesced and unmasked: fp32 (`terms=1`), or as three bf16 terms hi + mid + lo
  ([3, C, PP], `terms=3`: 24 significant bits, for exact bf16 tensor-core products with bf16
  streams). One launch of `mhc_triton.phi_pad_t`, or none for a served phi in fp32.
- `served_phi`: phi (same values) as a view of a zero-padded [C, PP] fp32 buffer, the layout
  `projection_phi(terms=1)` returns: the engine keeps its weights so, and its decode step
  launches no transposing copy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import mhc_triton as K
from birkhoff.kernels.mhc_mix import cdiv, pow2
from birkhoff.kernels.ops import traceable


def padded_logits(P: int) -> int:
    """PP: P padded to a power of two >= 16 (what tl.dot needs)."""
    return max(16, pow2(P))


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
    traceable(K.phi_pad_t)[(cdiv(C, BC),)](
        phi_PC.contiguous(), out, P, C, PP=PP, BC=BC, TERMS=terms
    )  # fmt: skip
    return out
