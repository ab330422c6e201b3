"""Triton kernel of a plain decode step's inputs (kernels/step_inputs.py) in one launch.

Legend: A rows of the step, B cache rows, N cache positions, K2 rope angles a token.

`decode_inputs`: BA rows a program. Row a (cache row rows[a], pending position n[a], live
where live[a] != 0) gets its position (n, or the trash slot where not live), its valid flag,
the rope tables' rows at that position and the token that the row's token buffer holds there:
pure loads and stores, the values of the gathers it replaces bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_inputs(
    n_ptr, live_ptr, rows_ptr, tokens_ptr, cos_ptr, sin_ptr, pos_ptr, valid_ptr, cos_out_ptr,
    sin_out_ptr, token_out_ptr, A, K2, stride_tokens, trash, BA: tl.constexpr,
    BK: tl.constexpr,
):  # fmt: skip
    a = tl.program_id(0) * BA + tl.arange(0, BA)
    a_ok = a < A
    live = tl.load(live_ptr + a, mask=a_ok, other=0) != 0
    n = tl.load(n_ptr + a, mask=a_ok, other=0).to(tl.int64)
    pos = tl.where(live, n, trash)
    row = tl.load(rows_ptr + a, mask=a_ok, other=0).to(tl.int64)
    tl.store(pos_ptr + a, pos, mask=a_ok)
    tl.store(valid_ptr + a, live, mask=a_ok)
    token = tl.load(tokens_ptr + row * stride_tokens + pos, mask=a_ok, other=0)
    tl.store(token_out_ptr + a, token, mask=a_ok)
    j = tl.arange(0, BK)
    ok = a_ok[:, None] & (j < K2)[None, :]
    src = pos[:, None] * K2 + j[None, :]
    dst = a.to(tl.int64)[:, None] * K2 + j[None, :]
    tl.store(cos_out_ptr + dst, tl.load(cos_ptr + src, mask=ok, other=0.0), mask=ok)
    tl.store(sin_out_ptr + dst, tl.load(sin_ptr + src, mask=ok, other=0.0), mask=ok)
