"""Sinkhorn-Knopp of one token's S x S logits inside one thread (Triton helpers).

Legend: N tokens, S streams, BN tokens per program (one per thread).

A token's matrix is a tuple of S*S [BN] vectors in row-major order (entry i*S + j), one vector
element per token, so every row and column sum is a chain of adds in one thread's registers:
no warp shuffles and no shared memory. (A [BN, S, S] tensor spreads each token's entries over
several threads, whose sums then cross threads at every one of the 2 t_max - 1 normalisations:
that was most of coeff_tail's time, at decode and in training.) Programs should hold at least
32 * num_warps tokens; fewer are computed redundantly by the spare threads (decode's one token).

The arithmetic is the eager `birkhoff.model.hyper.sinkhorn`'s, operation for operation: row
softmax, + eps, a column normalisation, then (t_max - 1) x (row, column), each an exact division
by (sum + eps). The backward reruns the forward once, keeping each normalisation's S
denominators in a scratch buffer [N, 2 t_max, S] (each thread rereads only what it wrote), then
walks back: dL/dM = (g - sum_along(g * Y)) / d for Y = M / d, and M = Y * d recovers the state
before it, so nothing is stored per step but the denominators.
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
def _along(m, v, S: tl.constexpr, ROWS: tl.constexpr, DIVIDE: tl.constexpr):
    """m[i, j] / v[i] (ROWS) or / v[j]; times instead of DIVIDE is False."""
    out = ()
    for ij in tl.static_range(S * S):
        d = v[ij // S] if ROWS else v[ij % S]
        out = out + (m[ij] / d if DIVIDE else m[ij] * d,)
    return out


@triton.jit
def _normalise(m, eps, S: tl.constexpr, ROWS: tl.constexpr):
    """(m with its rows or columns divided by (sum + eps), those S denominators)."""
    sums = _sums(m, S, ROWS)
    d = ()
    for a in tl.static_range(S):
        d = d + (sums[a] + eps,)
    return _along(m, d, S, ROWS, True), d


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


@triton.jit
def _store_vec(ptr, v, ok, S: tl.constexpr):
    for a in tl.static_range(S):
        tl.store(ptr + a, v[a], mask=ok)


@triton.jit
def _load_vec(ptr, ok, S: tl.constexpr):
    out = ()
    for a in tl.static_range(S):
        out = out + (tl.load(ptr + a, mask=ok, other=1.0),)
    return out


@triton.jit
def _step_back(g, y, d, S: tl.constexpr, ROWS: tl.constexpr):
    """Through Y = M / d (rows or columns): (dL/dM, M) from (dL/dY, Y)."""
    gy = ()
    for ij in tl.static_range(S * S):
        gy = gy + (g[ij] * y[ij],)
    dots = _sums(gy, S, ROWS)
    out = ()
    for ij in tl.static_range(S * S):
        dot = dots[ij // S] if ROWS else dots[ij % S]
        out = out + (g[ij] - dot,)
    return _along(out, d, S, ROWS, True), _along(y, d, S, ROWS, False)


@triton.jit
def sinkhorn_bwd(a, g, iters, eps, scr, ok, S: tl.constexpr):
    """dL/dp, p the row softmax of a, of `sinkhorn(a)` given g = dL/dH_res (`softmax_rows_bwd`
    finishes dL/da: the caller recomputes a there, so that the logits do not stay in registers
    through the walk back). scr: [BN] pointers to each token's scratch row [2 t_max, S] (fp32)
    for the denominators."""
    y, d = _normalise(_plus(_softmax_rows(a, S), eps, S), eps, S, False)
    _store_vec(scr, d, ok, S)
    for t in range(iters - 1):
        y, d = _normalise(y, eps, S, True)
        _store_vec(scr + (2 * t + 1) * S, d, ok, S)
        y, d = _normalise(y, eps, S, False)
        _store_vec(scr + (2 * t + 2) * S, d, ok, S)
    for back in range(iters - 1):
        t = iters - 2 - back
        g, y = _step_back(g, y, _load_vec(scr + (2 * t + 2) * S, ok, S), S, False)
        g, y = _step_back(g, y, _load_vec(scr + (2 * t + 1) * S, ok, S), S, True)
    g, _ = _step_back(g, y, _load_vec(scr, ok, S), S, False)
    return g


@triton.jit
def softmax_rows_bwd(a, g, S: tl.constexpr):
    """dL/da of p = row softmax of a, given g = dL/dp."""
    p = _softmax_rows(a, S)
    gp = ()
    for ij in tl.static_range(S * S):
        gp = gp + (g[ij] * p[ij],)
    dots = _sums(gp, S, True)
    out = ()
    for ij in tl.static_range(S * S):
        out = out + (p[ij] * (g[ij] - dots[ij // S]),)
    return out
