"""Triton kernels of the fused mHC coefficients: RMS + projection + Sinkhorn (fwd and bwd).

Legend: N tokens (B*T flattened), S streams (SP: S padded to a power of two), D model dim,
C = S*D, P logits per token (S*S + 2S for a hyper-connection, S for the output contraction),
PP: P padded to a power of two (>= 16).

- `coeff_proj`: one pass over the flattened streams gives the sum of squares and the
  projection raw = x @ phi^T on tensor cores, as partial sums over splits of the C columns, so
  a few tokens (decode) still spread over many programs. PREC "bf16x3" for bf16 streams: phi
  as three bf16 terms (24 significant bits), each a bf16 dot with x as stored (exact
  products, ~fp32 in all); "tf32x3" (three TF32 products of both operands split) for fp16
  streams and the engine's served fp32 phi; "ieee" for fp32 streams, so the fp32 path equals
  the eager one. phi comes transposed and zero-padded to [C, PP] (or [3, C, PP] terms), so its
  loads are coalesced and unmasked (`phi_pad_t` writes that copy in one launch).
- `coeff_tail`: sums the splits; logits = raw * rstd; alpha * logits + bias;
  H_pre = sigmoid + eps, H_post = 2 sigmoid, H_res = Sinkhorn (row softmax + eps, then column,
  then (t_max - 1) x (row, column) normalisation with eps in the denominators).
- `pre_mix_norm`: the engine's sublayer entry: coeff_tail's H_pre, the mix in and the sublayer's
  RMSNorm in one program per few tokens.
- `coeff_rest` (H_post and H_res alone, from the raw logits and rstd that pre_mix_norm stored,
  beside the sublayer in the engine): `mhc_rest_triton`, one token a thread.
- `coeff_bwd`: gradient of the pre-activations, of raw, and the per-token factor of the RMS
  scale's gradient. The Sinkhorn backward reruns the forward once, writing the 2 t_max - 1
  denominators (an [SP] vector each) to a scratch buffer, then walks back: the state entering
  normalisation k is the state after it times its denominators, so no state is stored and
  nothing is recomputed from the start (O(t_max), exact unrolled-autograd gradients up to
  rounding).
- `grad_x`, `grad_phi` (the projection's backward products): `mhc_grad_triton`.
The bf16 dots run as fp32 dots of the same values under the Triton interpreter (EMU), whose
bf16 dots are wrong, so the CPU tests check the split arithmetic too.
Padded stream slots (S < SP) are masked to zero at every step, so S need not be a power of two.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _f32(v):
    """A float argument as fp32: Triton's launcher passes Python floats as fp32, inductor's
    generated launcher as fp64 (which would promote the Sinkhorn state to fp64)."""
    return tl.cast(v, tl.float32)


@triton.jit
def _softmax_rows(a, valid):
    # Padded rows become uniform here and are zeroed; padded columns of real rows get exp = 0.
    a = tl.where(valid, a, -1.0e30)
    e = tl.exp(a - tl.max(a, axis=2)[:, :, None])
    return tl.where(valid, e / tl.sum(e, axis=2)[:, :, None], 0.0)


@triton.jit
def _state_before(a, valid, k, eps):
    """Sinkhorn state entering normalisation k (k >= 1): odd k normalise columns, even rows."""
    m = tl.where(valid, _softmax_rows(a, valid) + eps, 0.0)
    for step in range(1, k):
        if step % 2 == 1:
            m = m / (tl.sum(m, axis=1)[:, None, :] + eps)
        else:
            m = m / (tl.sum(m, axis=2)[:, :, None] + eps)
    return m


@triton.jit
def _sinkhorn_bwd(a, g, valid, iters, eps, scr_ptr, n64, n_ok, SP: tl.constexpr):
    """Gradient w.r.t. the logits a of Sinkhorn(a) given g = dL/dH_res.

    Normalisation Y = M / d, d the row (column) sums of M + eps, has the backward
    dL/dM = (g - sum_along(g * Y)) / d, and M = Y * d recovers its input; the row softmax p has
    p * (g - sum(g * p)). scr_ptr: [N, 2 t_max, SP] fp32 scratch for the denominators d.
    """
    s = tl.arange(0, SP)[None, :]
    scr = scr_ptr + n64[:, None] * (2 * iters * SP) + s
    y = tl.where(valid, _softmax_rows(a, valid) + eps, 0.0)
    for k in range(1, 2 * iters):  # the forward once, keeping each step's denominators
        if k % 2 == 1:
            col = tl.sum(y, axis=1) + eps
            tl.store(scr + k * SP, col, mask=n_ok[:, None])
            y = y / col[:, None, :]
        else:
            row = tl.sum(y, axis=2) + eps
            tl.store(scr + k * SP, row, mask=n_ok[:, None])
            y = y / row[:, :, None]
    tl.debug_barrier()  # the loads below may read what other threads stored
    for back in range(0, 2 * iters - 1):
        k = 2 * iters - 1 - back
        d = tl.load(scr + k * SP, mask=n_ok[:, None], other=1.0)
        # (branch-local names differ: Triton requires a name bound in both branches of a
        # runtime `if` to have one type, and the column and row vectors have different layouts)
        if k % 2 == 1:
            d_col = d[:, None, :]
            g = (g - tl.sum(g * y, axis=1)[:, None, :]) / d_col
            y = y * d_col
        else:
            d_row = d[:, :, None]
            g = (g - tl.sum(g * y, axis=2)[:, :, None]) / d_row
            y = y * d_row
        g = tl.where(valid, g, 0.0)
    p = _softmax_rows(a, valid)
    return p * (g - tl.sum(g * p, axis=2)[:, :, None])


@triton.jit
def _res_slots(ptr, n64, n_ok, stride, S: tl.constexpr, SP: tl.constexpr):
    """Pointers [BN, SP * SP] to each token's S x S row-major entries at ptr + n * stride, and
    the mask of the real ones (padded slots and tokens out of range off)."""
    f = tl.arange(0, SP * SP)
    i = f // SP
    j = f % SP
    ok = n_ok[:, None] & ((i < S) & (j < S))[None, :]
    return ptr + n64[:, None] * stride + (i * S + j)[None, :], ok


@triton.jit
def _res_load(ptr, n64, n_ok, stride, S: tl.constexpr, SP: tl.constexpr):
    """([BN, SP, SP] S x S entries of each token (`_res_slots`), zero in padded slots; the
    [BN, SP, SP] mask of the real ones). Loaded as [BN, SP * SP] and reshaped, so that a token's
    entries lie in one warp: a 3-D load can come out with the rows across warps (Triton 3.6
    does that at 32 tokens and 4 warps), and then each column sum of the Sinkhorn goes through
    shared memory and barriers (coeff_tail 29.7 -> 10.3 us a call at 16k tokens, coeff_bwd
    30.3 -> 22.0 on the H200)."""
    slots, ok = _res_slots(ptr, n64, n_ok, stride, S, SP)
    v = tl.load(slots, mask=ok, other=0.0)
    return tl.reshape(v, [v.shape[0], SP, SP]), tl.reshape(ok, [v.shape[0], SP, SP])


@triton.jit
def _res_store(ptr, m, n64, n_ok, stride, S: tl.constexpr, SP: tl.constexpr):
    """Stores [BN, SP, SP] m's real entries as `_res_load` reads them (no layout change)."""
    slots, ok = _res_slots(ptr, n64, n_ok, stride, S, SP)
    tl.store(slots, tl.reshape(m, [m.shape[0], SP * SP]), mask=ok)


@triton.jit
def _token_sums(N, BN: tl.constexpr, PP: tl.constexpr):
    """This program's BN tokens (index, in range, int64), the logit columns, and zeroed
    accumulators of the sum of squares [BN] and the projection [BN, PP]."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    sq = tl.zeros([BN], dtype=tl.float32)
    return n, n < N, n.to(tl.int64), tl.arange(0, PP), sq, tl.zeros([BN, PP], dtype=tl.float32)


@triton.jit
def coeff_proj(
    x_ptr, phit_ptr, part_ptr, sq_ptr, N, C, CHUNK,
    PP: tl.constexpr, PREC: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """This program's share of one pass over x: over BN tokens and the CHUNK columns (a multiple
    of BC) of split program_id(1), the sum of squares -> sq [splits, N] and the projection
    x @ phi^T -> part [splits, N, PP]. PREC "bf16x3" (bf16 x): phit holds phi as three bf16
    terms [3, C, PP] (`phi_pad_t`, TERMS 3), each a bf16 tensor-core dot with x as stored, whose
    products are exact (~fp32 in all); otherwise phit is fp32 [C, PP] and x goes to fp32."""
    n, n_ok, n64, p, sq, raw = _token_sums(N, BN, PP)
    start = tl.program_id(1) * CHUNK
    for c0 in range(start, tl.minimum(start + CHUNK, C), BC):
        c = c0 + tl.arange(0, BC)
        ok = n_ok[:, None] & (c < C)[None, :]
        xs = tl.load(x_ptr + n64[:, None] * C + c[None, :], mask=ok, other=0.0)
        xv = xs.to(tl.float32)
        sq += tl.sum(xv * xv, axis=1)
        tile = phit_ptr + c[:, None] * PP + p[None, :]
        if PREC == "bf16x3":
            for t in tl.static_range(3):
                term = tl.load(tile + t * C * PP, mask=(c < C)[:, None], other=0.0)
                raw = dot_bf16(xs, term, raw, EMU)
        else:
            phi_t = tl.load(tile, mask=(c < C)[:, None], other=0.0)
            raw = tl.dot(xv, phi_t, raw, input_precision=PREC)
    row = tl.program_id(1).to(tl.int64) * N + n64
    tl.store(part_ptr + row[:, None] * PP + p[None, :], raw, mask=n_ok[:, None])
    tl.store(sq_ptr + row, sq, mask=n_ok)


@triton.jit
def dot_bf16(a, b, acc, EMU: tl.constexpr):
    """acc + a @ b for bf16 a and b, accumulated in fp32 (exact products). EMU: as an fp32 dot of
    the same values (the Triton interpreter's bf16 dots are wrong)."""
    if EMU:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def split3(v):
    """fp32 v as three bf16 terms hi + mid + lo (24 significant bits, v's own to rounding)."""
    hi = v.to(tl.bfloat16)
    rest = v - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def coeff_tail(
    part_ptr, sq_ptr, raw_ptr, alpha_ptr, bias_ptr, pre_ptr, post_ptr, res_ptr, rstd_ptr,
    N, C, SPLITS, norm_eps, hc_eps, iters,
    S: tl.constexpr, SP: tl.constexpr, P: tl.constexpr, PP: tl.constexpr,
    WITH_RES: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr,
):  # fmt: skip
    """Sums coeff_proj's splits in a fixed order (deterministic), then per token: rstd, alpha
    and bias, H_pre, H_post and the Sinkhorn of H_res, all in fp32 registers."""
    hc_eps = _f32(hc_eps)
    n, n_ok, n64, h_pre, rstd = _pre(
        part_ptr, sq_ptr, raw_ptr, rstd_ptr, alpha_ptr, bias_ptr, N, C, SPLITS, norm_eps, hc_eps,
        S, SP, P, PP, BN, KB,
    )  # fmt: skip
    s = tl.arange(0, SP)[None, :]
    tl.store(pre_ptr + n64[:, None] * S + s, h_pre, mask=n_ok[:, None] & (s < S))
    if WITH_RES:
        _post_res(raw_ptr, alpha_ptr, bias_ptr, post_ptr, res_ptr, n64, n_ok, rstd, hc_eps, iters,
                  S, SP, P)  # fmt: skip


@triton.jit
def _pre(
    part_ptr, sq_ptr, raw_ptr, rstd_ptr, alpha_ptr, bias_ptr, N, C, SPLITS, norm_eps, hc_eps,
    S: tl.constexpr, SP: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, BN: tl.constexpr,
    KB: tl.constexpr,
):  # fmt: skip
    """This program's tokens (n, in range, int64), H_pre [BN, SP] and rstd [BN]; the raw logits
    and rstd are stored. The splits are read KB at a time as one [KB, BN, PP] load: decode's few
    tokens come in ~C / BC splits, and one split per loop step would wait out a memory latency
    per split."""
    n, n_ok, n64, p, sq, raw = _token_sums(N, BN, PP)
    kb = tl.arange(0, KB)
    for k0 in range(0, SPLITS, KB):
        row = (k0 + kb)[:, None] * N + n64[None, :]  # [KB, BN]
        ok = ((k0 + kb) < SPLITS)[:, None] & n_ok[None, :]
        part = tl.load(part_ptr + row[:, :, None] * PP + p[None, None, :], mask=ok[:, :, None],
                       other=0.0)  # fmt: skip
        raw += tl.sum(part, axis=0)
        sq += tl.sum(tl.load(sq_ptr + row, mask=ok, other=0.0), axis=0)
    # raw goes out (the backward and coeff_rest need it) and comes back in the [pre | post | res]
    # layout the code reads; the barrier makes every thread's stores visible to the program.
    tl.store(raw_ptr + n64[:, None] * P + p[None, :], raw, mask=n_ok[:, None] & (p < P)[None, :])
    tl.debug_barrier()
    rstd = tl.rsqrt(sq / C + _f32(norm_eps))
    tl.store(rstd_ptr + n, rstd, mask=n_ok)
    s = tl.arange(0, SP)[None, :]
    vec_ok = n_ok[:, None] & (s < S)
    z_pre = tl.load(raw_ptr + n64[:, None] * P + s, mask=vec_ok, other=0.0) * rstd[:, None]
    a_pre = tl.load(alpha_ptr) * z_pre + tl.load(bias_ptr + s, mask=s < S, other=0.0)
    return n, n_ok, n64, tl.sigmoid(a_pre) + hc_eps, rstd


@triton.jit
def pre_mix_norm(
    part_ptr, sq_ptr, x_ptr, w_ptr, alpha_ptr, bias_ptr, raw_ptr, rstd_ptr, y_ptr,
    N, D, SPLITS, norm_eps, hc_eps, rms_eps,
    S: tl.constexpr, SP: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, KB: tl.constexpr,
    BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """The engine's sublayer entry over all D columns of BN tokens a program: coeff_tail's H_pre
    (raw logits and rstd stored, for coeff_rest), y = sum_j H_pre[j] x_j rounded to y's dtype
    as mix_in_fwd's, then RMSNorm(y) * w as rms_norm_fwd's -> y_ptr [N, D]."""
    n, n_ok, n64, h_pre, _ = _pre(
        part_ptr, sq_ptr, raw_ptr, rstd_ptr, alpha_ptr, bias_ptr, N, S * D, SPLITS, norm_eps,
        _f32(hc_eps), S, SP, P, PP, BN, KB,
    )  # fmt: skip
    d = tl.arange(0, BD)
    ok = n_ok[:, None] & (d < D)[None, :]
    s = tl.arange(0, SP)[None, :]
    y = tl.zeros([BN, BD], dtype=tl.float32)
    for j in tl.static_range(S):
        h = tl.sum(tl.where(s == j, h_pre, 0.0), axis=1)  # column j, exactly
        xj = tl.load(x_ptr + n64[:, None] * (S * D) + j * D + d[None, :], mask=ok, other=0.0)
        y += h[:, None] * xj.to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
    y = y * tl.rsqrt(tl.sum(y * y, axis=1) / D + _f32(rms_eps))[:, None]
    y = y * tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + n64[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _post(
    raw_ptr, alpha_ptr, bias_ptr, post_ptr, n64, n_ok, rstd,
    S: tl.constexpr, SP: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    """H_post = 2 sigmoid of the BN tokens' post logits times rstd -> post_ptr [N, S]."""
    s = tl.arange(0, SP)[None, :]
    vec_ok = n_ok[:, None] & (s < S)
    z_post = tl.load(raw_ptr + n64[:, None] * P + S + s, mask=vec_ok, other=0.0) * rstd[:, None]
    a_post = tl.load(alpha_ptr + 1) * z_post + tl.load(bias_ptr + S + s, mask=s < S, other=0.0)
    tl.store(post_ptr + n64[:, None] * S + s, 2.0 * tl.sigmoid(a_post), mask=vec_ok)


@triton.jit
def _post_res(
    raw_ptr, alpha_ptr, bias_ptr, post_ptr, res_ptr, n64, n_ok, rstd, hc_eps, iters,
    S: tl.constexpr, SP: tl.constexpr, P: tl.constexpr,
):  # fmt: skip
    """H_post = 2 sigmoid and H_res = Sinkhorn of the BN tokens' raw logits times rstd."""
    _post(raw_ptr, alpha_ptr, bias_ptr, post_ptr, n64, n_ok, rstd, S, SP, P)
    z_res, valid = _res_load(raw_ptr + 2 * S, n64, n_ok, P, S, SP)
    b_res, _ = _res_load(bias_ptr + 2 * S, n64, n_ok, 0, S, SP)
    a_res = tl.load(alpha_ptr + 2) * (z_res * rstd[:, None, None]) + b_res
    m = _state_before(a_res, valid, 2 * iters, hc_eps)
    _res_store(res_ptr, m, n64, n_ok, S * S, S, SP)


@triton.jit
def coeff_bwd(
    raw_ptr, rstd_ptr, alpha_ptr, bias_ptr, gpre_ptr, gpost_ptr, gres_ptr,
    ga_ptr, graw_ptr, coef_ptr, scr_ptr,
    N, C, hc_eps, iters,
    S: tl.constexpr, SP: tl.constexpr, P: tl.constexpr, WITH_RES: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """g_a = dL/d(alpha z + b) [N,P], g_raw = g_a alpha rstd [N,P], and coef [N] with
    dL/dx (through rstd) = coef * x."""
    hc_eps = _f32(hc_eps)
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
        alpha = tl.load(alpha_ptr + 2)
        raw3, valid = _res_load(raw_ptr + 2 * S, n64, n_ok, P, S, SP)
        b_res, _ = _res_load(bias_ptr + 2 * S, n64, n_ok, 0, S, SP)
        a_res = alpha * (raw3 * rstd[:, None, None]) + b_res
        g, _ = _res_load(gres_ptr, n64, n_ok, S * S, S, SP)
        ga3 = _sinkhorn_bwd(a_res, g, valid, iters, hc_eps, scr_ptr, n64, n_ok, SP)
        _res_store(ga_ptr + 2 * S, ga3, n64, n_ok, P, S, SP)
        _res_store(graw_ptr + 2 * S, ga3 * alpha * rstd[:, None, None], n64, n_ok, P, S, SP)
        g_rstd += tl.sum(tl.sum(ga3 * alpha * raw3, axis=2), axis=1)
    # rstd = (sum x^2 / C + eps)^(-1/2)  =>  d rstd / d x_c = -rstd^3 x_c / C
    tl.store(coef_ptr + n, -g_rstd * rstd * rstd * rstd / C, mask=n_ok)


@triton.jit
def phi_pad_t(phi_ptr, out_ptr, P, C, PP: tl.constexpr, BC: tl.constexpr, TERMS: tl.constexpr):
    """out[C, PP] = phi[P, C]^T, zero in the padded columns p >= P (one launch instead of a
    fill and a strided copy): in fp32 (TERMS 1), or as the three bf16 terms of `split3`,
    out [3, C, PP] (TERMS 3)."""
    c = tl.program_id(0) * BC + tl.arange(0, BC)
    p = tl.arange(0, PP)
    ok = (c < C)[:, None] & (p < P)[None, :]
    tile = tl.load(phi_ptr + p[None, :] * C + c[:, None], mask=ok, other=0.0).to(tl.float32)
    out = out_ptr + c[:, None] * PP + p[None, :]
    if TERMS == 3:
        terms = split3(tile)
        for t in tl.static_range(3):
            tl.store(out + t * C * PP, terms[t], mask=(c < C)[:, None])
    else:
        tl.store(out, tile, mask=(c < C)[:, None])
