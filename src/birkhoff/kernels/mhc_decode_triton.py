"""Triton kernel of the engine's mHC sublayer entry: coefficients, mix in and RMSNorm in one
launch (forward only).

Legend: N tokens (B*T flattened), S streams, D model dim, C = S*D, P coefficient logits, PP: P
padded to a power of two (>= 16).

`mix_in_norm`: a grid of token blocks x column splits. Every program runs `mhc_triton.project`
(its share of the projection and of the sum of squares, as partials), then counts itself done
on its token block's counter; the block's last program (the one that sees SPLITS - 1) sums the
partials in a fixed order and runs `mhc_triton.coefficients` for the block's tokens (H_pre,
H_post, and the Sinkhorn of H_res one token a thread: the tokens in parallel threads), then
y = sum_j H_pre[j] x_j rounded to the output dtype, and h = RMSNorm(y) * w, the sublayer's
normalised input. At decode sizes each of those steps was a
launch of its own (coeff_proj, coeff_tail, mix_in, rms_norm) moving a few kilobytes: the steps
cost launches and memory latencies, not bytes.

Ordering: every thread's partial stores come before a barrier, and one thread's acq_rel atomic
publishes them at GPU scope; the last program reads them after its own acquire and barrier,
through L2 (".cg"), as cooperative groups' grid sync does. The last program resets its counter
to zero, so the counters (`mhc_decode.counters`) are zero between launches and a CUDA graph can
replay the launch. Launches that share counters must not run concurrently (one stream).
The sums are deterministic: the partials are added in split order, not by atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from birkhoff.kernels.mhc_triton import coefficients, project


@triton.jit
def mix_in_norm(
    x_ptr, phit_ptr, alpha_ptr, bias_ptr, w_ptr, part_ptr, sq_ptr, raw_ptr, rstd_ptr, cnt_ptr,
    h_ptr, pre_ptr, post_ptr, res_ptr, N, C, D, CHUNK, SPLITS, norm_eps, hc_eps, iters,
    S: tl.constexpr, SP: tl.constexpr, P: tl.constexpr, PP: tl.constexpr,
    WITH_RES: tl.constexpr, PREC: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
    BD: tl.constexpr, KB: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """h [N, D] = RMSNorm(sum_j H_pre[j] x_j) * w and H_pre, H_post, H_res (fp32) of x [N, S, D];
    part [SPLITS, N, PP], sq [SPLITS, N], raw [N, P], rstd [N]: scratch."""
    block, split = tl.program_id(0), tl.program_id(1)
    project(x_ptr, phit_ptr, part_ptr, sq_ptr, N, C, CHUNK, block, split, PP, PREC, BN, BC, EMU)
    tl.debug_barrier()  # every thread's partials are stored before the count goes up
    done = tl.atomic_add(cnt_ptr + block, 1, sem="acq_rel", scope="gpu")
    if done == SPLITS - 1:  # the block's last program: every split's partials are in
        tl.store(cnt_ptr + block, 0)
        coefficients(
            part_ptr, sq_ptr, raw_ptr, alpha_ptr, bias_ptr, pre_ptr, post_ptr, res_ptr, rstd_ptr,
            block, N, C, SPLITS, norm_eps, hc_eps, iters, S, SP, P, PP, WITH_RES, BN, KB, ".cg",
            True,
        )  # fmt: skip
        tl.debug_barrier()  # H_pre of the block's tokens, stored by every thread
        _mix_norm(x_ptr, pre_ptr, w_ptr, h_ptr, block, N, D, norm_eps, S, BN, BD)


@triton.jit
def _mix_norm(
    x_ptr, pre_ptr, w_ptr, h_ptr, block, N, D, eps,
    S: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """h = RMSNorm(y) * w of y = sum_j H_pre[j] x_j over the block's tokens, as the separate ops
    compute it: y accumulated in fp32 and rounded to h's dtype, its RMS in fp32 of that y. The
    first pass writes y into h, the second rescales it in place."""
    eps = tl.cast(eps, tl.float32)
    n = block * BN + tl.arange(0, BN)
    n_ok = n < N
    n64 = n.to(tl.int64)
    sq = tl.zeros([BN], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = n_ok[:, None] & (d < D)[None, :]
        y = tl.zeros([BN, BD], dtype=tl.float32)
        for j in tl.static_range(S):
            h = tl.load(pre_ptr + n64 * S + j, mask=n_ok, other=0.0)
            xj = tl.load(x_ptr + n64[:, None] * (S * D) + j * D + d[None, :], mask=ok, other=0.0)
            y += h[:, None] * xj.to(tl.float32)
        y = y.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + n64[:, None] * D + d[None, :], y, mask=ok)
        yf = y.to(tl.float32)
        sq += tl.sum(yf * yf, axis=1)
    rstd = tl.rsqrt(sq / D + eps)
    tl.debug_barrier()
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = n_ok[:, None] & (d < D)[None, :]
        out = h_ptr + n64[:, None] * D + d[None, :]
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        y = tl.load(out, mask=ok, other=0.0).to(tl.float32) * rstd[:, None] * w[None, :]
        tl.store(out, y.to(h_ptr.dtype.element_ty), mask=ok)
