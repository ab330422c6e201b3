"""Triton kernel of a speculative step's verify tail (kernels/accept.py) in one launch.

Legend: A rows of the step, J drafts a row, T = J + 1 verified positions, V vocab, BV vocab
entries a block.

`verify_accept`, one program per row a (cache row rows[a], pending position n[a]):
1. the main model's distribution at each of the T positions, as `sample_row` forms it (logp
   and p stored in scratch rows; p one-hot at the argmax for greedy rows), then a barrier, so
   every thread reads what the others stored;
2. drafts accepted left to right while u_j * q_j(d_j) < p_j(d_j), u_j from splitmix64(key ^
   (n * TAGS + ACCEPT + j + 1)) for j = 1..J (engine/speculative.accept_drafts: the comparison in
   fp64, as torch promotes it);
3. the next token from the residual max(0, p_a - q_a) at the first rejected position a (q = 0
   past the last draft, so with every draft accepted it is p_J; p_a itself where the residual
   is empty), by the inverse CDF with u from splitmix64(key ^ (n * TAGS + SAMPLE)): an fp64
   scan for the total, then the same scan again counting the entries whose cumulative mass is
   <= u * total and those < total (`rng.sample_inverse_cdf`'s clamp);
4. the next token into tokens[row, n + 1 + a] (the trash slot for rows that are not live),
   out[a] = (a, the T emitted tokens: the drafts with the next token at a and at J, their logp
   from the scratch rows) as fp64, and for live rows the next step's inputs: n_rows[row] = n +
   1 + a, and starts[k - 1, row] = max(0, n - k + 1), draft depth k's first position to
   recompute.
The logp and p are sample_rows' bits; the residual's scan runs in another order than torch's
cumsum, so a token can differ only where u * total falls within rounding of a boundary.
"""

from __future__ import annotations

import triton
import triton.language as tl

from birkhoff.kernels.rng_triton import uniform_bits
from birkhoff.kernels.sample_triton import _sample_row


@triton.jit
def _residual(p_row, q_row, v, V, has_q, use_p):
    """A block of the residual max(0, p - q) as fp32 (p itself where `use_p`)."""
    p = tl.load(p_row + v, mask=v < V, other=0.0)
    q = tl.load(q_row + v, mask=(v < V) & has_q, other=0.0)
    return tl.where(use_p, p, tl.maximum(p - q, 0.0))


@triton.jit
def verify_accept(
    logits_ptr, q_ptr, drafts_ptr, rows_ptr, n_ptr, live_ptr, temp_ptr, greedy_ptr, key_ptr,
    tokens_ptr, n_rows_ptr, starts_ptr, logp_ptr, probs_ptr, out_ptr, num_ptr, V, J,
    stride_tokens, stride_starts, trash, TAGS: tl.constexpr, SAMPLE: tl.constexpr,
    ACCEPT: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
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
        _sample_row(logits_ptr + r * V, logp_ptr + r * V, probs_ptr + r * V, t, greedy, 0.0, V,
                    False, BV)  # fmt: skip
    tl.debug_barrier()
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
    p_row = probs_ptr + (a * T + num) * V
    q_row = q_ptr + (a * J + num) * V
    has_q = num < J
    largest = tl.zeros([1], dtype=tl.float32)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        largest = tl.maximum(largest, tl.max(_residual(p_row, q_row, v, V, has_q, False), 0))
    use_p = largest <= 0  # rounding emptied the residual where p ~ q
    total = tl.zeros([1], dtype=tl.float64)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        r = _residual(p_row, q_row, v, V, has_q, use_p).to(tl.float64)
        total += tl.max(tl.cumsum(r, axis=0), axis=0)
    target = uniform_bits(key, n * TAGS + SAMPLE) * total
    below = tl.zeros([1], dtype=tl.int64)
    short = tl.zeros([1], dtype=tl.int64)
    run = tl.zeros([1], dtype=tl.float64)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        cs = tl.cumsum(_residual(p_row, q_row, v, V, has_q, use_p).to(tl.float64), axis=0)
        c = run + cs
        below += tl.sum(((c <= target) & (v < V)).to(tl.int64), axis=0)
        short += tl.sum(((c < total) & (v < V)).to(tl.int64), axis=0)
        run += tl.max(cs, axis=0)
    token = tl.minimum(below, short)
    slot = tl.where(live, n + 1 + num, trash)
    tl.store(tokens_ptr + row * stride_tokens + slot, token)
    live_1 = tl.where(live, one == 0, False)  # a [1] mask (the interpreter's scalar & is an int)
    tl.store(n_rows_ptr + row + one, n + 1 + num, mask=live_1)
    for k in range(1, J + 1):
        start = tl.maximum(n - k + 1, 0)
        tl.store(starts_ptr + (k - 1) * stride_starts + row + one, start, mask=live_1)
    tl.store(num_ptr + a + one, num)
    res = out_ptr + a * (1 + 2 * T)
    tl.store(res + one, num.to(tl.float64))
    for i in range(T):
        draft = tl.load(drafts_ptr + a * J + tl.minimum(i, J - 1) + one)  # (i = J: unread)
        e = tl.where((i == num) | (i == J), token, draft)
        tl.store(res + 1 + i + one, e.to(tl.float64))
        lp = tl.load(logp_ptr + (a * T + i) * V + e)
        tl.store(res + 1 + T + i + one, lp.to(tl.float64))
