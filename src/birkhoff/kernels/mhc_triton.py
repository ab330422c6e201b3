"""Triton kernels of the fused mHC ops: coefficients + Sinkhorn, mix in, mix out (fwd and bwd).

Legend: N tokens (B*T flattened), S streams (SP: S padded to a power of two), D model dim,
C = S*D, P logits per token (S*S + 2S for a hyper-connection, S for the output contraction).

Every kernel works per token in fp32 registers and reads or writes each [N,S,D] tensor once:
- `coeff_fwd`: one pass over the flattened streams gives the sum of squares -> rstd and the
  projection raw = x @ phi^T (an fp32 dot, no TF32); logits = raw * rstd; alpha * logits + bias;
  H_pre = sigmoid + eps, H_post = 2 sigmoid, H_res = Sinkhorn (row softmax + eps, then column,
  then (t_max - 1) x (row, column) normalisation with eps in the denominators).
- `coeff_bwd`: gradient of the pre-activations, of raw, and the per-token factor of the RMS
  scale's gradient; `rms_grad` reads x once more for g_x = g_raw @ phi + that term and for
  g_phi = g_raw^T @ x (per-program partials, summed by the caller). The Sinkhorn
  backward stores no intermediate: the state before normalisation k is recomputed from the
  logits (O(t_max^2) S x S steps per token, all on chip, exact unrolled-autograd gradients).
- `mix_in_*`: y = sum_j h[j] x_j and its backward (g_x = h g_y, g_h[j] = <g_y, x_j>).
- `mix_out_*`: y_k = h_post[k] f + sum_j h_res[j, k] x_j and its backward
  (g_f = sum_k h_post[k] g_y_k, g_x_j = sum_k h_res[j, k] g_y_k, g_h_post, g_h_res by <., .>).
Padded stream slots (S < SP) are masked to zero at every step, so S need not be a power of two.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _softmax_rows(a, valid):
    # Padded rows become uniform here and are zeroed; padded columns of real rows get exp = 0.
    a = tl.where(valid, a, -1.0e30)
    e = tl.exp(a - tl.max(a, axis=2)[:, :, None])
    return tl.where(valid, e / tl.sum(e, axis=2)[:, :, None], 0.0)


@triton.jit
def _state_before(a, valid, k, eps):
    """Sinkhorn state entering normalisation k (k >= 1): odd k normalise columns, even rows.

    The normalisations are written inline (not as helpers): the Triton interpreter pays for
    every nested jit call, and this loop runs O(t_max^2) times in the backward.
    """
    m = tl.where(valid, _softmax_rows(a, valid) + eps, 0.0)
    for step in range(1, k):
        if step % 2 == 1:
            m = m / (tl.sum(m, axis=1)[:, None, :] + eps)
        else:
            m = m / (tl.sum(m, axis=2)[:, :, None] + eps)
    return m


@triton.jit
def _sinkhorn_bwd(a, g, valid, iters, eps):
    """Gradient w.r.t. the logits a of Sinkhorn(a) given g = dL/dH_res, recomputing each state.

    Normalisation Y = M / (s + eps), s the row (column) sums of M, has the backward
    dL/dM = (g - sum_along(g * Y)) / (s + eps); the row softmax p has p * (g - sum(g * p)).
    """
    for back in range(0, 2 * iters - 1):
        k = 2 * iters - 1 - back
        m = _state_before(a, valid, k, eps)
        # (branch-local names differ: Triton requires a name bound in both branches of a
        # runtime `if` to have one type, and the column and row sums have different shapes)
        if k % 2 == 1:
            col = tl.sum(m, axis=1)[:, None, :] + eps
            g = (g - tl.sum(g * (m / col), axis=1)[:, None, :]) / col
        else:
            row = tl.sum(m, axis=2)[:, :, None] + eps
            g = (g - tl.sum(g * (m / row), axis=2)[:, :, None]) / row
        g = tl.where(valid, g, 0.0)
    p = _softmax_rows(a, valid)
    return p * (g - tl.sum(g * p, axis=2)[:, :, None])


@triton.jit
def _res_offsets(n64, n_ok, S: tl.constexpr, SP: tl.constexpr):
    i = tl.arange(0, SP)[None, :, None]
    j = tl.arange(0, SP)[None, None, :]
    valid = n_ok[:, None, None] & (i < S) & (j < S)
    return i * S + j, valid


@triton.jit
def coeff_fwd(
    x_ptr, phi_ptr, raw_ptr, alpha_ptr, bias_ptr, pre_ptr, post_ptr, res_ptr, rstd_ptr,
    N, C, norm_eps, hc_eps, iters,
    S: tl.constexpr, SP: tl.constexpr, P: tl.constexpr, PP: tl.constexpr,
    WITH_RES: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    n64 = n.to(tl.int64)
    p = tl.arange(0, PP)
    sq = tl.zeros([BN], dtype=tl.float32)
    raw = tl.zeros([BN, PP], dtype=tl.float32)
    for c0 in range(0, C, BC):  # one pass over x: sum of squares and the projection
        c = c0 + tl.arange(0, BC)
        ok = n_ok[:, None] & (c < C)[None, :]
        xv = tl.load(x_ptr + n64[:, None] * C + c[None, :], mask=ok, other=0.0).to(tl.float32)
        sq += tl.sum(xv * xv, axis=1)
        phi_ok = (c < C)[:, None] & (p < P)[None, :]
        phi_t = tl.load(phi_ptr + p[None, :] * C + c[:, None], mask=phi_ok, other=0.0)
        raw = tl.dot(xv, phi_t, raw, input_precision="ieee")
    # raw goes out (the backward needs it) and comes back in the [pre | post | res] layout the
    # code below reads; the barrier makes every thread's stores visible to the whole program.
    tl.store(raw_ptr + n64[:, None] * P + p[None, :], raw, mask=n_ok[:, None] & (p < P)[None, :])
    tl.debug_barrier()
    rstd = tl.rsqrt(sq / C + norm_eps)
    tl.store(rstd_ptr + n, rstd, mask=n_ok)
    s = tl.arange(0, SP)[None, :]
    vec_ok = n_ok[:, None] & (s < S)
    raw_row = raw_ptr + n64[:, None] * P
    a_pre = tl.load(alpha_ptr) * (tl.load(raw_row + s, mask=vec_ok, other=0.0) * rstd[:, None])
    a_pre += tl.load(bias_ptr + s, mask=s < S, other=0.0)
    tl.store(pre_ptr + n64[:, None] * S + s, tl.sigmoid(a_pre) + hc_eps, mask=vec_ok)
    if WITH_RES:
        z_post = tl.load(raw_row + S + s, mask=vec_ok, other=0.0) * rstd[:, None]
        a_post = tl.load(alpha_ptr + 1) * z_post + tl.load(bias_ptr + S + s, mask=s < S, other=0.0)
        tl.store(post_ptr + n64[:, None] * S + s, 2.0 * tl.sigmoid(a_post), mask=vec_ok)
        ij, valid = _res_offsets(n64, n_ok, S, SP)
        z_res = tl.load(raw_ptr + n64[:, None, None] * P + 2 * S + ij, mask=valid, other=0.0)
        b_res = tl.load(bias_ptr + 2 * S + ij, mask=valid, other=0.0)
        a_res = tl.load(alpha_ptr + 2) * (z_res * rstd[:, None, None]) + b_res
        m = _state_before(a_res, valid, 2 * iters, hc_eps)
        tl.store(res_ptr + n64[:, None, None] * (S * S) + ij, m, mask=valid)


@triton.jit
def coeff_bwd(
    raw_ptr, rstd_ptr, alpha_ptr, bias_ptr, gpre_ptr, gpost_ptr, gres_ptr,
    ga_ptr, graw_ptr, coef_ptr,
    N, C, hc_eps, iters,
    S: tl.constexpr, SP: tl.constexpr, P: tl.constexpr, WITH_RES: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """g_a = dL/d(alpha z + b) [N,P], g_raw = g_a alpha rstd [N,P], and coef [N] with
    dL/dx (through rstd) = coef * x."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    n64 = n.to(tl.int64)
    rstd = tl.load(rstd_ptr + n, mask=n_ok, other=0.0)
    s = tl.arange(0, SP)[None, :]
    vec_ok = n_ok[:, None] & (s < S)
    raw_row, ga_row, graw_row = (
        raw_ptr + n64[:, None] * P,
        ga_ptr + n64[:, None] * P,
        graw_ptr + n64[:, None] * P,
    )
    alpha = tl.load(alpha_ptr)
    raw = tl.load(raw_row + s, mask=vec_ok, other=0.0)
    sig = tl.sigmoid(alpha * raw * rstd[:, None] + tl.load(bias_ptr + s, mask=s < S, other=0.0))
    ga = tl.load(gpre_ptr + n64[:, None] * S + s, mask=vec_ok, other=0.0) * sig * (1.0 - sig)
    tl.store(ga_row + s, ga, mask=vec_ok)
    tl.store(graw_row + s, ga * alpha * rstd[:, None], mask=vec_ok)
    g_rstd = tl.sum(ga * alpha * raw, axis=1)
    if WITH_RES:
        alpha = tl.load(alpha_ptr + 1)
        raw = tl.load(raw_row + S + s, mask=vec_ok, other=0.0)
        b = tl.load(bias_ptr + S + s, mask=s < S, other=0.0)
        sig = tl.sigmoid(alpha * raw * rstd[:, None] + b)
        g = tl.load(gpost_ptr + n64[:, None] * S + s, mask=vec_ok, other=0.0)
        ga = 2.0 * g * sig * (1.0 - sig)
        tl.store(ga_row + S + s, ga, mask=vec_ok)
        tl.store(graw_row + S + s, ga * alpha * rstd[:, None], mask=vec_ok)
        g_rstd += tl.sum(ga * alpha * raw, axis=1)
        ij, valid = _res_offsets(n64, n_ok, S, SP)
        alpha = tl.load(alpha_ptr + 2)
        raw3 = tl.load(raw_ptr + n64[:, None, None] * P + 2 * S + ij, mask=valid, other=0.0)
        b_res = tl.load(bias_ptr + 2 * S + ij, mask=valid, other=0.0)
        a_res = alpha * (raw3 * rstd[:, None, None]) + b_res
        g = tl.load(gres_ptr + n64[:, None, None] * (S * S) + ij, mask=valid, other=0.0)
        ga3 = _sinkhorn_bwd(a_res, g, valid, iters, hc_eps)
        tl.store(ga_ptr + n64[:, None, None] * P + 2 * S + ij, ga3, mask=valid)
        tl.store(
            graw_ptr + n64[:, None, None] * P + 2 * S + ij,
            ga3 * alpha * rstd[:, None, None],
            mask=valid,
        )
        g_rstd += tl.sum(tl.sum(ga3 * alpha * raw3, axis=2), axis=1)
    # rstd = (sum x^2 / C + eps)^(-1/2)  =>  d rstd / d x_c = -rstd^3 x_c / C
    tl.store(coef_ptr + n, -g_rstd * rstd * rstd * rstd / C, mask=n_ok)


@triton.jit
def rms_grad(
    graw_ptr, phi_ptr, x_ptr, coef_ptr, gx_ptr, gphi_ptr, N, C, TOKENS,
    P: tl.constexpr, PP: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """One read of x for both input-side gradients of the projection and the RMS scale:
    g_x = g_raw @ phi + coef * x (written once in the dtype of x) and this program's share of
    g_phi = g_raw^T @ x over its TOKENS tokens (a partial [PP, BC] block; the caller sums the
    partials in a fixed order, so g_phi is deterministic). fp32 dots without TF32."""
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    p = tl.arange(0, PP)
    phi = tl.load(phi_ptr + p[:, None] * C + c[None, :], mask=(p < P)[:, None] & (c < C)[None, :],
                  other=0.0)  # fmt: skip
    acc = tl.zeros([PP, BC], dtype=tl.float32)
    start = tl.program_id(0) * TOKENS
    for n0 in range(start, tl.minimum(start + TOKENS, N), BN):
        n = n0 + tl.arange(0, BN)
        n_ok = n < N
        ok = n_ok[:, None] & (c < C)[None, :]
        offs = n.to(tl.int64)[:, None] * C + c[None, :]
        g_raw = tl.load(graw_ptr + n.to(tl.int64)[:, None] * P + p[None, :],
                        mask=n_ok[:, None] & (p < P)[None, :], other=0.0)  # fmt: skip
        coef = tl.load(coef_ptr + n, mask=n_ok, other=0.0)
        xv = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        g = tl.dot(g_raw, phi, input_precision="ieee") + coef[:, None] * xv
        tl.store(gx_ptr + offs, g.to(gx_ptr.dtype.element_ty), mask=ok)
        acc = tl.dot(tl.trans(g_raw), xv, acc, input_precision="ieee")
    part = gphi_ptr + tl.program_id(0).to(tl.int64) * PP * C
    tl.store(part + p[:, None] * C + c[None, :], acc, mask=(c < C)[None, :])


@triton.jit
def mix_in_fwd(x_ptr, h_ptr, y_ptr, D, S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    h = tl.load(h_ptr + n * S + s, mask=s < S, other=0.0).to(tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = (s < S)[:, None] & (d < D)[None, :]
        xv = tl.load(x_ptr + n * S * D + s[:, None] * D + d[None, :], mask=ok, other=0.0)
        y = tl.sum(h[:, None] * xv.to(tl.float32), axis=0)
        tl.store(y_ptr + n * D + d, y.to(y_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def mix_in_bwd(
    gy_ptr, x_ptr, h_ptr, gx_ptr, gh_ptr, D, S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr
):
    n = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    h = tl.load(h_ptr + n * S + s, mask=s < S, other=0.0).to(tl.float32)
    acc = tl.zeros([SP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = (s < S)[:, None] & (d < D)[None, :]
        offs = n * S * D + s[:, None] * D + d[None, :]
        gy = tl.load(gy_ptr + n * D + d, mask=d < D, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(gx_ptr + offs, (h[:, None] * gy[None, :]).to(gx_ptr.dtype.element_ty), mask=ok)
        acc += tl.sum(xv * gy[None, :], axis=1)
    tl.store(gh_ptr + n * S + s, acc, mask=s < S)


@triton.jit
def _mix_out_coeffs(post_ptr, res_ptr, n, S: tl.constexpr, SP: tl.constexpr):
    s = tl.arange(0, SP)
    j, k = s[:, None], s[None, :]
    post = tl.load(post_ptr + n * S + s, mask=s < S, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + n * S * S + j * S + k, mask=(j < S) & (k < S), other=0.0)
    return s, post, res.to(tl.float32)


@triton.jit
def mix_out_fwd(
    x_ptr, f_ptr, post_ptr, res_ptr, y_ptr, D, S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr
):
    n = tl.program_id(0).to(tl.int64)
    s, post, res = _mix_out_coeffs(post_ptr, res_ptr, n, S, SP)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = (s < S)[:, None] & (d < D)[None, :]
        offs = n * S * D + s[:, None] * D + d[None, :]
        xv = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        f = tl.load(f_ptr + n * D + d, mask=d < D, other=0.0).to(tl.float32)
        y = tl.sum(res[:, :, None] * xv[:, None, :], axis=0) + post[:, None] * f[None, :]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def mix_out_bwd(
    gy_ptr, x_ptr, f_ptr, post_ptr, res_ptr, gx_ptr, gf_ptr, gpost_ptr, gres_ptr,
    D, S: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    s, post, res = _mix_out_coeffs(post_ptr, res_ptr, n, S, SP)
    acc_post = tl.zeros([SP], dtype=tl.float32)
    acc_res = tl.zeros([SP, SP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        ok = (s < S)[:, None] & (d < D)[None, :]
        offs = n * S * D + s[:, None] * D + d[None, :]
        gy = tl.load(gy_ptr + offs, mask=ok, other=0.0).to(tl.float32)  # [k, d]
        xv = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)  # [j, d]
        f = tl.load(f_ptr + n * D + d, mask=d < D, other=0.0).to(tl.float32)
        gf = tl.sum(post[:, None] * gy, axis=0)
        tl.store(gf_ptr + n * D + d, gf.to(gf_ptr.dtype.element_ty), mask=d < D)
        gx = tl.sum(res[:, :, None] * gy[None, :, :], axis=1)
        tl.store(gx_ptr + offs, gx.to(gx_ptr.dtype.element_ty), mask=ok)
        acc_post += tl.sum(gy * f[None, :], axis=1)
        acc_res += tl.sum(xv[:, None, :] * gy[None, :, :], axis=2)
    j, k = s[:, None], s[None, :]
    tl.store(gpost_ptr + n * S + s, acc_post, mask=s < S)
    tl.store(gres_ptr + n * S * S + j * S + k, acc_res, mask=(j < S) & (k < S))
