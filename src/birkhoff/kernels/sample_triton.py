"""Triton kernels of the engine's per-row sampling (engine/sampling.py) in one launch.

Legend: N rows, V vocab, BV vocab entries a block; R rows of the engine's tables, B cache rows.

`_sample_row` (one program per row) makes three passes over the row in BV-wide blocks:
1. z = logits / temperature (fp32), its running max and rescaled sum of exp (online softmax);
2. logp = (z - max) - log(sum), as torch's log_softmax forms it; the first index of the
   largest logp (the greedy token); probs = exp(logp), or one-hot at that index for greedy
   rows; the fp64 cumulative mass of probs (a scan per block, carried across blocks);
3. (rows with a uniform to sample from, not greedy) the same scan again, bit for bit, to count
   the entries whose cumulative mass is <= u * total (the first index past it is the token)
   and those < total (the last token with mass: the clamp of `rng.sample_inverse_cdf`).
Triton's exp and log are the GPU's fast approximations (relative error ~1e-7 to ~2e-6 over
the logit ranges of a vocabulary), and the sums run in another order than torch's (blocks, a
parallel scan): logp and probs agree with the eager functions within ~1e-5 relative, and a
sampled token differs only where u * total falls that close to a cumulative-mass boundary.

- `sample_rows`: the row's temperature, greedy flag and uniform given per row; stores logp,
  probs and the token.
- `sample_next` (a sampling site of a step and its bookkeeping): row a of the step is cache
  row rows[a] at pending position n[a]; its temperature and greedy flag come from the engine's
  per-row tables, its uniform from splitmix64(key[row] ^ (n * TAGS + TAG)) (rng_triton, the
  bits of `splitmix_uniform`); the token goes into tokens[row, n + offset] (the trash slot for
  rows that are not live) and token[a], and (token, its logp) into out[a] as fp64. The logp
  of the token is read back from the row pass 2 stored, after a barrier (recomputed from the
  logit outside `_sample_row`, it had other bits than sample_rows' on the GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from birkhoff.kernels.rng_triton import uniform_bits


@triton.jit
def _sample_row(logits, logp_row, probs_row, t, greedy, u, V, HAS_U: tl.constexpr,
                BV: tl.constexpr):  # fmt: skip
    """The token [1] (int64) of one row; stores its logp and probs. `u` is read only where
    HAS_U and the row is not greedy."""
    m = tl.full([1], float("-inf"), tl.float32)
    s = tl.zeros([1], dtype=tl.float32)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        z = tl.load(logits + v, mask=v < V, other=float("-inf")).to(tl.float32) / t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    log_s = tl.log(s)
    best = tl.full([1], float("-inf"), tl.float32)
    best_i = tl.zeros([1], dtype=tl.int64)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        z = tl.load(logits + v, mask=v < V, other=float("-inf")).to(tl.float32) / t
        lp = (z - m) - log_s
        tl.store(logp_row + v, lp, mask=v < V)
        block_best = tl.max(lp, axis=0)
        first = tl.min(tl.where(lp == block_best, v, V), axis=0).to(tl.int64)
        best_i = tl.where(block_best > best, first, best_i)
        best = tl.maximum(best, block_best)
    total = tl.zeros([1], dtype=tl.float64)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        lp = tl.load(logp_row + v, mask=v < V, other=float("-inf"))
        p = tl.where(greedy, tl.where(v == best_i, 1.0, 0.0), tl.exp(lp))
        tl.store(probs_row + v, p, mask=v < V)
        total += tl.max(tl.cumsum(p.to(tl.float64), axis=0), axis=0)
    token = best_i
    if HAS_U:  # noqa: SIM102 (a compile-time branch around a runtime one)
        if not greedy:
            target = u * total
            below = tl.zeros([1], dtype=tl.int64)
            short = tl.zeros([1], dtype=tl.int64)
            run = tl.zeros([1], dtype=tl.float64)
            for v0 in range(0, V, BV):
                v = v0 + tl.arange(0, BV)
                p = tl.load(probs_row + v, mask=v < V, other=0.0).to(tl.float64)
                cs = tl.cumsum(p, axis=0)
                c = run + cs
                below += tl.sum(((c <= target) & (v < V)).to(tl.int64), axis=0)
                short += tl.sum(((c < total) & (v < V)).to(tl.int64), axis=0)
                run += tl.max(cs, axis=0)
            token = tl.minimum(below, short)
    return token


@triton.jit
def sample_rows(
    logits_ptr, temp_ptr, greedy_ptr, u_ptr, logp_ptr, probs_ptr, token_ptr, V,
    HAS_U: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    u = tl.load(u_ptr + row) if HAS_U else 0.0
    token = _sample_row(logits_ptr + row * V, logp_ptr + row * V, probs_ptr + row * V, t, greedy,
                        u, V, HAS_U, BV)  # fmt: skip
    tl.store(token_ptr + row + tl.arange(0, 1), token)


@triton.jit
def sample_next(
    logits_ptr, rows_ptr, n_ptr, live_ptr, temp_ptr, greedy_ptr, key_ptr, tokens_ptr,
    logp_ptr, probs_ptr, out_ptr, token_ptr, V, stride_tokens, trash, offset, TAGS: tl.constexpr,
    TAG: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    a = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + a)
    n = tl.load(n_ptr + a).to(tl.int64)
    live = tl.load(live_ptr + a) != 0
    t = tl.load(temp_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    u = uniform_bits(tl.load(key_ptr + row), n * TAGS + TAG)
    token = _sample_row(logits_ptr + a * V, logp_ptr + a * V, probs_ptr + a * V, t, greedy, u, V,
                        True, BV)  # fmt: skip
    tl.debug_barrier()  # the token's logp was stored by another thread of the program
    logp = tl.load(logp_ptr + a * V + token)
    slot = tl.where(live, n + offset, trash)
    one = tl.arange(0, 1)
    tl.store(tokens_ptr + row * stride_tokens + slot + one, token)
    tl.store(token_ptr + a + one, token)
    tl.store(out_ptr + 2 * a + one, token.to(tl.float64))
    tl.store(out_ptr + 2 * a + 1 + one, logp.to(tl.float64))
