"""Triton kernel of a step's chunk inputs (kernels/step_inputs.py) in one launch.

Legend: A rows of the step, T positions a row, B cache rows, N cache positions, K2 rope angles
a token.

`chunk_inputs`: a program per (row, block of BT positions). Row a is cache row rows[a]; its
position t is p = start[a] + t (start 0 without HAS_START), valid where live[a] != 0 and
p < end[a] (every position of a live row without HAS_END). It writes the slot (p, or the trash
slot where not valid), the valid flag, the rope tables' rows at the slot and the token the
row's token buffer holds at p + SHIFT (at the trash slot where not valid): pure integer
arithmetic, loads and stores, the values of the eager ops it replaces bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_inputs(
    start_ptr, end_ptr, live_ptr, rows_ptr, tokens_ptr, cos_ptr, sin_ptr, pos_ptr, valid_ptr,
    cos_out_ptr, sin_out_ptr, token_out_ptr, T, K2, stride_tokens, trash, shift,
    HAS_START: tl.constexpr, HAS_END: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
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
    token = tl.load(tokens_ptr + row * stride_tokens + tl.where(valid, p + shift, trash),
                    mask=t_ok, other=0)  # fmt: skip
    tl.store(token_out_ptr + out, token, mask=t_ok)
    j = tl.arange(0, BK)
    ok = t_ok[:, None] & (j < K2)[None, :]
    src = slot[:, None] * K2 + j[None, :]
    dst = out.to(tl.int64)[:, None] * K2 + j[None, :]
    tl.store(cos_out_ptr + dst, tl.load(cos_ptr + src, mask=ok, other=0.0), mask=ok)
    tl.store(sin_out_ptr + dst, tl.load(sin_ptr + src, mask=ok, other=0.0), mask=ok)
