"""A step's chunk inputs as one fused forward-only custom op (`birkhoff::chunk_inputs`).

Legend: A rows of the step, T positions a row, B cache rows, N cache positions, K2 rope angles
a token.

Eagerly (`engine.step.step_chunk`) a chunk is a handful of small launches: positions, the valid
mask, the slots, two rope table gathers and the tokens' index. `chunk_inputs` writes the same
values in one launch (integer arithmetic, loads and stores: bit for bit); the eager ops stay
the reference and the CPU path. No host sync, so it runs inside the engine's CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import check_device, pow2, tl, triton
from birkhoff.kernels.sample import check_tokens


@triton.jit
def chunk_inputs_kernel(
    start_ptr,
    end_ptr,
    live_ptr,
    rows_ptr,
    tokens_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    valid_ptr,
    cos_out_ptr,
    sin_out_ptr,
    token_out_ptr,
    T,
    K2,
    stride_tokens,
    trash,
    shift,
    HAS_START: tl.constexpr,
    HAS_END: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    t_ok = t < T
    p = t.to(tl.int64)
    if HAS_START:
        p += tl.load(start_ptr + a).to(tl.int64)
    valid = (tl.load(live_ptr + a) != 0) & t_ok
    if HAS_END:
        valid = valid & (p < tl.load(end_ptr + a).to(tl.int64))
    slot = tl.where(valid, p, trash)
    row = tl.load(rows_ptr + a).to(tl.int64)
    out = a * T + t
    tl.store(pos_ptr + out, slot, mask=t_ok)
    tl.store(valid_ptr + out, valid, mask=t_ok)
    token = tl.load(
        tokens_ptr + row * stride_tokens + tl.where(valid, p + shift, trash), mask=t_ok, other=0
    )
    tl.store(token_out_ptr + out, token, mask=t_ok)
    j = tl.arange(0, BK)
    ok = t_ok[:, None] & (j < K2)[None, :]
    src = slot[:, None] * K2 + j[None, :]
    dst = out.to(tl.int64)[:, None] * K2 + j[None, :]
    tl.store(cos_out_ptr + dst, tl.load(cos_ptr + src, mask=ok, other=0.0), mask=ok)
    tl.store(sin_out_ptr + dst, tl.load(sin_ptr + src, mask=ok, other=0.0), mask=ok)


POSITIONS = 16  # positions a program, at most


@torch.library.custom_op("birkhoff::chunk_inputs", mutates_args=())
def chunk_inputs(
    start_A: Tensor | None,
    end_A: Tensor | None,
    live_A: Tensor,
    rows_A: Tensor,
    tokens_BN: Tensor,
    cos_NK2: Tensor,
    sin_NK2: Tensor,
    trash: int,
    T: int,
    shift: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(slots [A, T] int64, valid [A, T] bool, cos and sin [A, T, K2], tokens [A, T] int64) of
    positions p = start + t (start 0 where None) of cache rows `rows_A`: valid where live != 0
    and p < end (no bound where None); the slot is p where valid, else `trash`; cos, sin: the
    tables' rows at the slots; tokens: tokens_BN[row, p + shift] where valid, else the trash
    slot's. start, end and rows int64 [A]; live any integer or bool [A]."""
    check_device(live_A)
    A = live_A.shape[0]
    named = (("start", start_A), ("end", end_A), ("rows", rows_A), ("live", live_A))
    for name, t in named:
        if t is not None and (t.shape != (A,) or (name != "live" and t.dtype != torch.long)):
            raise ValueError(
                f"chunk_inputs: {name} must be {A} entries"
                f"{'' if name == 'live' else ' of int64'}, got "
                f"{t.dtype}{tuple(t.shape)}"
            )
    if cos_NK2.dim() != 2 or sin_NK2.shape != cos_NK2.shape:
        raise ValueError(
            f"chunk_inputs: rope tables {tuple(cos_NK2.shape)} / "
            f"{tuple(sin_NK2.shape)} must be one [N, K2] shape"
        )
    check_tokens("chunk_inputs", tokens_BN, trash, cos_NK2.shape[0])
    if T < 1:
        raise ValueError(f"chunk_inputs: T = {T} positions, need >= 1")
    outs = _fake(start_A, end_A, live_A, rows_A, tokens_BN, cos_NK2, sin_NK2, trash, T, shift)
    if A:
        K2, BT = cos_NK2.shape[1], min(POSITIONS, pow2(T))
        chunk_inputs_kernel[(A, -(-T // BT))](
            live_A if start_A is None else start_A.contiguous(),
            live_A if end_A is None else end_A.contiguous(),
            live_A.contiguous(),
            rows_A.contiguous(),
            tokens_BN,
            cos_NK2.contiguous(),
            sin_NK2.contiguous(),
            *outs,
            T,
            K2,
            tokens_BN.stride(0),
            trash,
            shift,
            HAS_START=start_A is not None,
            HAS_END=end_A is not None,
            BT=BT,
            BK=max(2, pow2(K2)),
            num_warps=2,
        )
    return outs


@chunk_inputs.register_fake
def _fake(start_A, end_A, live_A, rows_A, tokens_BN, cos_NK2, sin_NK2, trash, T, shift):  # type: ignore[no-untyped-def]  # noqa: E501
    A, K2 = live_A.shape[0], cos_NK2.shape[1]
    slots = rows_A.new_empty((A, T), dtype=torch.long)
    valid = torch.empty_like(slots, dtype=torch.bool)
    angles = [cos_NK2.new_empty((A, T, K2)) for _ in range(2)]
    return slots, valid, *angles, torch.empty_like(slots)
