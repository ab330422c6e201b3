"""A speculative step's verify tail as one fused forward-only custom op (`birkhoff::verify_accept`).

Legend: A rows of the step, J drafts a row, T = J + 1 verified positions, V vocab; R rows of the
engine's tables, B cache rows.

After the verify pass, `engine.step.verify` eagerly runs ~55 small launches: the main model's
distributions, the uniforms, `speculative.accept_drafts`' rejection sampling, the next token's
write and the next step's inputs. `verify_accept` computes the same in one launch: the
distributions of `sample.sample_row` and the acceptance decisions bit for bit, the residual's
draw to the rounding of its fp64 scan. Left out: top-k / top-p rows (the eager path runs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import check_inputs, pow2, tl, triton
from birkhoff.kernels.rng import uniform_bits
from birkhoff.kernels.sample import (
    BV,
    check_row_major,
    check_step_rows,
    check_tensor,
    check_tokens,
    inverse_cdf,
    residual,
    sample_row,
)


@triton.jit
def _num_accepted(probs_ptr, q_ptr, drafts_ptr, key, a, n, V, J, TAGS, ACCEPT):
    """The drafts [1] (int64) row a accepts: draft j stands while u_j * q(d_j) < p(d_j)."""
    T = J + 1
    one = tl.arange(0, 1)
    num = tl.zeros([1], dtype=tl.int64)
    going = tl.full([1], 1, tl.int1)
    for j in range(J):
        d = tl.load(drafts_ptr + a * J + j + one)
        p_d = tl.load(probs_ptr + (a * T + j) * V + d).to(tl.float64)
        q_d = tl.load(q_ptr + (a * J + j) * V + d).to(tl.float64)
        u_j = uniform_bits(key, n * TAGS + ACCEPT + j + 1)
        going = going & (u_j * q_d < p_d)
        num += going.to(tl.int64)
    return num


@triton.jit
def _next_token(p_row, q_row, has_q, u, V, BV: tl.constexpr):
    """The token [1] (int64) drawn from the residual max(0, p - q) (from p where q is absent, or
    where rounding emptied the residual because p ~ q)."""
    largest = tl.zeros([1], dtype=tl.float32)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        largest = tl.maximum(largest, tl.max(residual(p_row, q_row, v, V, has_q, False), 0))
    use_p = largest <= 0
    total = tl.zeros([1], dtype=tl.float64)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        r = residual(p_row, q_row, v, V, has_q, use_p).to(tl.float64)
        total += tl.max(tl.cumsum(r, axis=0), axis=0)
    return inverse_cdf(p_row, q_row, V, has_q, use_p, u * total, total, BV)


@triton.jit
def _store_results(res, logp_ptr, drafts_ptr, a, num, token, V, J):
    """res[0] = a, res[1 + i] = the T = J + 1 emitted tokens, res[1 + T + i] their logprobs."""
    T = J + 1
    one = tl.arange(0, 1)
    tl.store(res + one, num.to(tl.float64))
    for i in range(T):
        draft = tl.load(drafts_ptr + a * J + tl.minimum(i, J - 1) + one)  # (i = J: unread)
        e = tl.where((i == num) | (i == J), token, draft)
        tl.store(res + 1 + i + one, e.to(tl.float64))
        lp = tl.load(logp_ptr + (a * T + i) * V + e)
        tl.store(res + 1 + T + i + one, lp.to(tl.float64))


@triton.jit
def verify_accept_kernel(
    logits_ptr,
    q_ptr,
    drafts_ptr,
    rows_ptr,
    n_ptr,
    live_ptr,
    temp_ptr,
    greedy_ptr,
    key_ptr,
    tokens_ptr,
    n_rows_ptr,
    starts_ptr,
    logp_ptr,
    probs_ptr,
    out_ptr,
    num_ptr,
    V,
    J,
    stride_tokens,
    stride_starts,
    trash,
    TAGS: tl.constexpr,
    SAMPLE: tl.constexpr,
    ACCEPT: tl.constexpr,
    BV: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)
    T = J + 1
    row = tl.load(rows_ptr + a)
    n = tl.load(n_ptr + a).to(tl.int64)
    live = tl.load(live_ptr + a) != 0
    t = tl.load(temp_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    key = tl.load(key_ptr + row)
    for i in range(T):
        r = a * T + i
        sample_row(
            logits_ptr + r * V, logp_ptr + r * V, probs_ptr + r * V, t, greedy, 0.0, V, False, BV
        )
    tl.debug_barrier()
    num = _num_accepted(probs_ptr, q_ptr, drafts_ptr, key, a, n, V, J, TAGS, ACCEPT)
    p_row = probs_ptr + (a * T + num) * V
    q_row = q_ptr + (a * J + num) * V
    u = uniform_bits(key, n * TAGS + SAMPLE)
    token = _next_token(p_row, q_row, num < J, u, V, BV)
    slot = tl.where(live, n + 1 + num, trash)
    tl.store(tokens_ptr + row * stride_tokens + slot, token)
    one = tl.arange(0, 1)
    live_1 = tl.where(live, one == 0, False)  # a [1] mask (the interpreter's scalar & is an int)
    tl.store(n_rows_ptr + row + one, n + 1 + num, mask=live_1)
    for k in range(1, J + 1):
        start = tl.maximum(n - k + 1, 0)
        tl.store(starts_ptr + (k - 1) * stride_starts + row + one, start, mask=live_1)
    tl.store(num_ptr + a + one, num)
    _store_results(out_ptr + a * (1 + 2 * T), logp_ptr, drafts_ptr, a, num, token, V, J)


@torch.library.custom_op("birkhoff::verify_accept", mutates_args=("tokens_BN", "n_B", "starts_JB"))
def verify_accept(
    logits_ATV: Tensor,
    q_AJV: Tensor,
    drafts_AJ: Tensor,
    rows_A: Tensor,
    n_A: Tensor,
    live_A: Tensor,
    temperature_R: Tensor,
    greedy_R: Tensor,
    key_R: Tensor,
    tokens_BN: Tensor,
    n_B: Tensor,
    starts_JB: Tensor,
    trash: int,
    tags: int,
    sample_tag: int,
    accept_tag: int,
) -> tuple[Tensor, Tensor]:
    """(accepted drafts a [A] int64, [A, 1 + 2T] fp64: a, the T emitted tokens, their logprobs)
    for the main model's logits [A, T, V] at positions n..n+J of cache rows `rows_A`, the J
    drafts [A, J] (int64) and the distributions q [A, J, V] (fp32) they were drawn from: exact
    rejection sampling as `speculative.accept_drafts`, with row r's temperature_R / greedy_R and
    the uniforms splitmix64(key_R[r] ^ (n * tags + tag)) of tags accept_tag + j and sample_tag,
    as `rng.RequestRandom.uniform` draws them. The next token is also written to
    tokens_BN[row, n + 1 + a] (column `trash` for rows whose live entry is 0), and a live row's
    next step reads n_B[row] = n + 1 + a and starts_JB[k - 1, row] = max(0, n - k + 1) for
    k = 1..J (int64; the first position draft depth k recomputes)."""
    check_inputs(logits_ATV)
    if logits_ATV.dim() != 3 or drafts_AJ.dim() != 2:
        raise ValueError(
            f"verify_accept: logits must be [A, T, V] and drafts [A, J], got "
            f"{tuple(logits_ATV.shape)} / {tuple(drafts_AJ.shape)}"
        )
    (A, T, V), J = logits_ATV.shape, drafts_AJ.shape[1]
    if T != J + 1 or J < 1:
        raise ValueError(f"verify_accept: {T} verified positions for {J} drafts (need J + 1)")
    check_tensor("verify_accept", "q", q_AJV, torch.float32, (A, J, V))
    check_tensor("verify_accept", "drafts", drafts_AJ, torch.long, (A, J))
    check_step_rows("verify_accept", A, rows_A, n_A, live_A, temperature_R, greedy_R, key_R)
    check_tokens("verify_accept", tokens_BN, trash)
    check_tensor("verify_accept", "n_B", n_B, torch.long, (None,))
    check_row_major("verify_accept", "starts", starts_JB, "[J, B]")
    if starts_JB.shape[0] < J or starts_JB.shape[1] != n_B.shape[0]:
        raise ValueError(
            f"verify_accept: starts {tuple(starts_JB.shape)} for {J} drafts and {n_B.shape[0]} rows"
        )
    num, out = _fake(logits_ATV, drafts_AJ)
    if A and V:
        scratch = logits_ATV.new_empty((2, A, T, V), dtype=torch.float32)  # logp, p
        verify_accept_kernel[(A,)](
            logits_ATV.contiguous(),
            q_AJV,
            drafts_AJ,
            rows_A,
            n_A,
            live_A.contiguous(),
            temperature_R,
            greedy_R,
            key_R,
            tokens_BN,
            n_B,
            starts_JB,
            scratch[0],
            scratch[1],
            out,
            num,
            V,
            J,
            tokens_BN.stride(0),
            starts_JB.stride(0),
            trash,
            TAGS=tags,
            SAMPLE=sample_tag,
            ACCEPT=accept_tag,
            BV=min(BV, max(16, pow2(V))),
            num_warps=4,
        )
    return num, out


def _fake(logits_ATV: Tensor, drafts_AJ: Tensor) -> tuple[Tensor, Tensor]:
    A, T = logits_ATV.shape[:2]
    num = drafts_AJ.new_empty((A,), dtype=torch.long)
    return num, logits_ATV.new_empty((A, 1 + 2 * T), dtype=torch.float64)


@verify_accept.register_fake
def _(logits_ATV, q_AJV, drafts_AJ, *args):  # type: ignore[no-untyped-def]
    return _fake(logits_ATV, drafts_AJ)
