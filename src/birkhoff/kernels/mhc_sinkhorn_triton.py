# mypy: disable-error-code="assignment, misc"
# (mypy cannot follow a tuple that grows one entry per unrolled step)
"""Sinkhorn-Knopp of one token's S x S logits inside one thread (Triton helpers, forward).

Legend: N tokens, S streams, BN tokens per program (one per thread).

A token's matrix is a tuple of S*S [BN] vectors in row-major order (entry i*S + j), one vector
element per token, so every row and column sum is a chain of adds in one thread's registers:
no warp shuffles, no shared memory, and a program's tokens run in parallel threads. (The
[BN, S, S] tiles of `mhc_triton` spread a token's entries over several threads, whose sums cross
threads at every one of the 2 t_max - 1 normalisations: their cost grows with BN, ~3.7 us of
device time at 1 or 2 tokens a warp and ~7.5 us at 16 tokens over 4 warps on the H200, where a
token a thread stays flat up to a thread per token.) `mhc_triton.coefficients` runs it where
a program's tokens are few and its warps many (the engine's fused sublayer entry); training
keeps the tiles (its programs hold 32 tokens in 4 warps, and the two were even there).

The arithmetic is the eager `birkhoff.model.hyper.sinkhorn`'s: row softmax, + eps, a column
normalisation, then (t_max - 1) x (row, column), each entry times the reciprocal of its
(sum + eps) (within an ulp of the eager division; S divisions a step instead of S*S).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_entries(ptr, ok, S: tl.constexpr):
    """The S*S vectors ptr[ij] (ptr: [BN] pointers to each token's row-major matrix)."""
    out = ()
    for ij in tl.static_range(S * S):
        out = out + (tl.load(ptr + ij, mask=ok, other=0.0),)
    return out


@triton.jit
def store_entries(ptr, m, ok, S: tl.constexpr):
    for ij in tl.static_range(S * S):
        tl.store(ptr + ij, m[ij], mask=ok)


@triton.jit
def res_logits(z, rstd, alpha, bias_ptr, S: tl.constexpr):
    """alpha * (z * rstd) + bias for each of the S*S res logits z (tuples of
    [BN] vectors)."""
    out = ()
    for ij in tl.static_range(S * S):
        out = out + (alpha * (z[ij] * rstd) + tl.load(bias_ptr + ij),)
    return out


@triton.jit
def _sums(m, S: tl.constexpr, ROWS: tl.constexpr):
    """The S row sums (ROWS) or column sums of m."""
    out = ()
    for a in tl.static_range(S):
        tot = m[a * S] if ROWS else m[a]
        for b in tl.static_range(1, S):
            tot += m[a * S + b] if ROWS else m[b * S + a]
        out = out + (tot,)
    return out


@triton.jit
def _along(m, v, S: tl.constexpr, ROWS: tl.constexpr):
    """m[i, j] * v[i] (ROWS) or * v[j]."""
    out = ()
    for ij in tl.static_range(S * S):
        out = out + (m[ij] * (v[ij // S] if ROWS else v[ij % S]),)
    return out


@triton.jit
def _inverses(d, S: tl.constexpr):
    out = ()
    for a in tl.static_range(S):
        out = out + (1.0 / d[a],)
    return out


@triton.jit
def _normalise(m, eps, S: tl.constexpr, ROWS: tl.constexpr):
    """(m with its rows or columns divided by (sum + eps), those S denominators). Each entry is
    multiplied by its denominator's reciprocal: S divisions a step instead of S*S, which one
    thread runs serially (decode has one token, one warp)."""
    sums = _sums(m, S, ROWS)
    d = ()
    for a in tl.static_range(S):
        d = d + (sums[a] + eps,)
    return _along(m, _inverses(d, S), S, ROWS), d


@triton.jit
def _softmax_rows(a, S: tl.constexpr):
    out = ()
    for i in tl.static_range(S):
        top = a[i * S]
        for j in tl.static_range(1, S):
            top = tl.maximum(top, a[i * S + j])
        e = ()
        for j in tl.static_range(S):
            e = e + (tl.exp(a[i * S + j] - top),)
        tot = e[0]
        for j in tl.static_range(1, S):
            tot += e[j]
        for j in tl.static_range(S):
            out = out + (e[j] / tot,)
    return out


@triton.jit
def _plus(m, eps, S: tl.constexpr):
    out = ()
    for ij in tl.static_range(S * S):
        out = out + (m[ij] + eps,)
    return out


@triton.jit
def sinkhorn(a, iters, eps, S: tl.constexpr):
    """H_res = Sinkhorn(a) for logits a (iters >= 1 normalisation rounds, `hyper.sinkhorn`)."""
    m, _ = _normalise(_plus(_softmax_rows(a, S), eps, S), eps, S, False)
    for _ in range(iters - 1):
        m, _ = _normalise(m, eps, S, True)
        m, _ = _normalise(m, eps, S, False)
    return m
