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
- `coeff_bwd`: gradient of the pre-activations, of raw, and the per-token factor of the RMS
  scale's gradient. The Sinkhorn (forward and backward: `mhc_sinkhorn_triton`) runs inside one
  thread per token; its backward reruns the forward once, writing the 2 t_max - 1 denominators
  to a scratch buffer, then walks back (O(t_max), exact unrolled-autograd gradients up to
  rounding).
- `grad_x`, `grad_phi` (the projection's backward products): `mhc_grad_triton`.
The bf16 dots run as fp32 dots of the same values under the Triton interpreter (EMU), whose
bf16 dots are wrong, so the CPU tests check the split arithmetic too.
Padded stream slots (S < SP) of the [BN, SP] vectors are masked to zero, so S need not be a power of
two; the Sinkhorn holds exactly S*S entries.
"""

from __future__ import annotations

import triton
import triton.language as tl

from birkhoff.kernels import mhc_sinkhorn_triton as SK


@triton.jit
def _f32(v):
    """A float argument as fp32: Triton's launcher passes Python floats as fp32, inductor's
    generated launcher as fp64 (which would promote the Sinkhorn state to fp64)."""
    return tl.cast(v, tl.float32)


@triton.jit
def _res_logits(z, rstd, alpha, bias_ptr, S: tl.constexpr):
    """alpha * (z * rstd) + bias for each of the S*S res logits z (`mhc_sinkhorn_triton`'s
    tuple of [BN] vectors)."""
    out = ()
    for ij in tl.static_range(S * S):
        out = out + (alpha * (z[ij] * rstd) + tl.load(bias_ptr + ij),)
    return out


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
    and bias, H_pre, H_post and the Sinkhorn of H_res, all in fp32 registers. The splits are
    read KB at a time as one [KB, BN, PP] load: decode's few tokens come in ~C / BC splits, and
    one split per loop step would wait out a memory latency per split."""
    norm_eps, hc_eps = _f32(norm_eps), _f32(hc_eps)
    n, n_ok, n64, p, sq, raw = _token_sums(N, BN, PP)
    kb = tl.arange(0, KB)
    for k0 in range(0, SPLITS, KB):
        row = (k0 + kb)[:, None] * N + n64[None, :]  # [KB, BN]
        ok = ((k0 + kb) < SPLITS)[:, None] & n_ok[None, :]
        part = tl.load(part_ptr + row[:, :, None] * PP + p[None, None, :], mask=ok[:, :, None],
                       other=0.0)  # fmt: skip
        raw += tl.sum(part, axis=0)
        sq += tl.sum(tl.load(sq_ptr + row, mask=ok, other=0.0), axis=0)
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
    h_pre = tl.sigmoid(a_pre) + hc_eps
    tl.store(pre_ptr + n64[:, None] * S + s, h_pre, mask=vec_ok)
    if WITH_RES:
        z_post = tl.load(raw_row + S + s, mask=vec_ok, other=0.0) * rstd[:, None]
        a_post = tl.load(alpha_ptr + 1) * z_post + tl.load(bias_ptr + S + s, mask=s < S, other=0.0)
        tl.store(post_ptr + n64[:, None] * S + s, 2.0 * tl.sigmoid(a_post), mask=vec_ok)
        z = SK.load_entries(raw_ptr + n64 * P + 2 * S, n_ok, S)
        a = _res_logits(z, rstd, tl.load(alpha_ptr + 2), bias_ptr + 2 * S, S)
        m = SK.sinkhorn(a, iters, hc_eps, S)
        SK.store_entries(res_ptr + n64 * (S * S), m, n_ok, S)


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
        z_row = raw_ptr + n64 * P + 2 * S
        a = _res_logits(SK.load_entries(z_row, n_ok, S), rstd, alpha, bias_ptr + 2 * S, S)
        g = SK.load_entries(gres_ptr + n64 * (S * S), n_ok, S)
        g = SK.sinkhorn_bwd(a, g, iters, hc_eps, scr_ptr + n64 * (2 * iters * S), n_ok, S)
        z = SK.load_entries(z_row, n_ok, S)  # again: not held through the walk back
        ga = SK.softmax_rows_bwd(_res_logits(z, rstd, alpha, bias_ptr + 2 * S, S), g, S)
        SK.store_entries(ga_ptr + n64 * P + 2 * S, ga, n_ok, S)
        for ij in tl.static_range(S * S):
            tl.store(graw_ptr + n64 * P + 2 * S + ij, ga[ij] * alpha * rstd, mask=n_ok)
            g_rstd += ga[ij] * alpha * z[ij]
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
