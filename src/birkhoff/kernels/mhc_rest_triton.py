"""The engine's H_post and H_res kernel (`coeff_rest`), one token a thread.

Legend: N tokens, S streams (SP: S padded to a power of two), P = S*S + 2S logits, BN tokens a
program (32 a warp).

`coeff_rest` runs on a side stream beside a sublayer's attention or MLP (kernels/mhc_entry.py),
so what it costs is not its own time but what it takes from the GEMMs that share its SMs. In
the training kernels' [BN, SP, SP] tiles a token's entries spread over several threads, whose
sums crossed threads at every one of the Sinkhorn's 2 t_max - 1 normalisations: at batch 256
that kernel ran ~12 us a call on 8 programs of 4 warps, and the GEMMs beside it took ~85 us a
step longer than without it (docs/results.md). Here a token's S*S entries are a tuple of [BN]
vectors, one element per thread: every row and column sum is a chain of adds in one thread's
registers (no shuffles, no shared memory), and one warp serves 32 tokens; a decode step's
tokens (up to 256) run as one program of up to 8 warps (`mhc_entry.REST_WARPS`), one SM taken
from the GEMM beside it where eight one-warp programs took eight (docs/results.md).

Values: coeff_tail's arithmetic (`mhc_triton._post_res`) operation for operation: H_post = 2
sigmoid; H_res = the row softmax, + eps, a column normalisation, then (t_max - 1) x (row,
column), each a division by (sum + eps). The sums run in index order: bit for bit under the
interpreter (which sums the tiles in that order); compiled, the tiles' sums may pair
differently (H_res within ~1e-7).
"""

# mypy: disable-error-code="assignment, misc"
# (mypy cannot follow a tuple that grows one entry per unrolled step)
from __future__ import annotations

import triton
import triton.language as tl

from birkhoff.kernels.mhc_triton import _f32, _post


@triton.jit
def _sums(m, S: tl.constexpr, ROWS: tl.constexpr):
    """The S row sums (ROWS) or column sums of the row-major entries m, in index order."""
    out = ()
    for a in tl.static_range(S):
        tot = m[a * S] if ROWS else m[a]
        for b in tl.static_range(1, S):
            tot += m[a * S + b] if ROWS else m[b * S + a]
        out = out + (tot,)
    return out


@triton.jit
def _normalise(m, eps, S: tl.constexpr, ROWS: tl.constexpr):
    """m with each row (ROWS) or column divided by its sum + eps."""
    sums = _sums(m, S, ROWS)
    out = ()
    for ij in tl.static_range(S * S):
        out = out + (m[ij] / (sums[ij // S] + eps if ROWS else sums[ij % S] + eps),)
    return out


@triton.jit
def _softmax_rows_plus(a, eps, S: tl.constexpr):
    """The row softmax of the logits a, + eps (the Sinkhorn's start)."""
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
            out = out + (e[j] / tot + eps,)
    return out


@triton.jit
def coeff_rest(
    raw_ptr, rstd_ptr, alpha_ptr, bias_ptr, post_ptr, res_ptr, N, hc_eps, iters,
    S: tl.constexpr, SP: tl.constexpr, P: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """H_post [N, S] and H_res [N, S, S] (fp32) from the raw logits [N, P] and rstd [N] that
    pre_mix_norm (or coeff_tail without them) stored."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    n64 = n.to(tl.int64)
    hc_eps = _f32(hc_eps)
    rstd = tl.load(rstd_ptr + n, mask=n_ok, other=0.0)
    _post(raw_ptr, alpha_ptr, bias_ptr, post_ptr, n64, n_ok, rstd, S, SP, P)
    alpha = tl.load(alpha_ptr + 2)
    a = ()
    for ij in tl.static_range(S * S):
        z = tl.load(raw_ptr + n64 * P + 2 * S + ij, mask=n_ok, other=0.0)
        a = a + (alpha * (z * rstd) + tl.load(bias_ptr + 2 * S + ij),)
    m = _normalise(_softmax_rows_plus(a, hc_eps, S), hc_eps, S, False)
    for _ in range(iters - 1):
        m = _normalise(_normalise(m, hc_eps, S, True), hc_eps, S, False)
    for ij in tl.static_range(S * S):
        tl.store(res_ptr + n64 * (S * S) + ij, m[ij], mask=n_ok)
