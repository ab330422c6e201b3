"""Fused mHC coefficients with autograd: RMS + projection + Sinkhorn, forward and backward.

Legend: B batch, T tokens (any leading shape; N = B*T), S streams (SP: padded to a power of
two), D model dim, C = S*D, P coefficient logits (PP: padded to a power of two >= 16).

`coeff_proj` reads x once for the sum of squares and raw = x @ phi^T (tensor cores at ~fp32
accuracy, split over column blocks so decode's few tokens fill the GPU); `coeff_tail` sums the
splits and forms H_pre, H_post and H_res (Sinkhorn); `coeff_bwd` reruns the Sinkhorn once and
walks back through its stored denominators. The ops (`mhc_coefficients`,
`coefficients_and_mix_in[_streams]`, `contraction_weights`, `contract`) mirror the eager ones
of `birkhoff.model.hyper`; with a mix in, the backward writes x's gradient once. Coefficients
are fp32; fp64 is rejected. Left out: the projection's backward products (`projection_grad`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import INTERPRET, cdiv, check_inputs, pow2, tl, triton
from birkhoff.kernels.fused_op import FusedOp, traceable
from birkhoff.kernels.mhc.configs import Launch, launch, pads
from birkhoff.kernels.mhc.mixes import mix_in_into, mix_in_weight_grad
from birkhoff.kernels.mhc.phi import dot_bf16, is_served, projection_phi
from birkhoff.kernels.mhc.projection_grad import projection_grads


@triton.jit
def f32(v):
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
    shared memory and barriers (docs/log/kernels.md)."""
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
    x_ptr,
    phit_ptr,
    part_ptr,
    sq_ptr,
    N,
    C,
    CHUNK,
    PP: tl.constexpr,
    PREC: tl.constexpr,
    BN: tl.constexpr,
    BC: tl.constexpr,
    EMU: tl.constexpr,
):
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
def coeff_tail(
    part_ptr,
    sq_ptr,
    raw_ptr,
    alpha_ptr,
    bias_ptr,
    pre_ptr,
    post_ptr,
    res_ptr,
    rstd_ptr,
    N,
    C,
    SPLITS,
    norm_eps,
    hc_eps,
    iters,
    S: tl.constexpr,
    SP: tl.constexpr,
    P: tl.constexpr,
    PP: tl.constexpr,
    WITH_RES: tl.constexpr,
    BN: tl.constexpr,
    KB: tl.constexpr,
):
    """Sums coeff_proj's splits in a fixed order (deterministic), then per token: rstd, alpha
    and bias, H_pre, H_post and the Sinkhorn of H_res, all in fp32 registers."""
    hc_eps = f32(hc_eps)
    n, n_ok, n64, h_pre, rstd = tail_pre(
        part_ptr,
        sq_ptr,
        raw_ptr,
        rstd_ptr,
        alpha_ptr,
        bias_ptr,
        N,
        C,
        SPLITS,
        norm_eps,
        hc_eps,
        S,
        SP,
        P,
        PP,
        BN,
        KB,
    )
    s = tl.arange(0, SP)[None, :]
    tl.store(pre_ptr + n64[:, None] * S + s, h_pre, mask=n_ok[:, None] & (s < S))
    if WITH_RES:
        _post_res(
            raw_ptr,
            alpha_ptr,
            bias_ptr,
            post_ptr,
            res_ptr,
            n64,
            n_ok,
            rstd,
            hc_eps,
            iters,
            S,
            SP,
            P,
        )


@triton.jit
def tail_pre(
    part_ptr,
    sq_ptr,
    raw_ptr,
    rstd_ptr,
    alpha_ptr,
    bias_ptr,
    N,
    C,
    SPLITS,
    norm_eps,
    hc_eps,
    S: tl.constexpr,
    SP: tl.constexpr,
    P: tl.constexpr,
    PP: tl.constexpr,
    BN: tl.constexpr,
    KB: tl.constexpr,
):
    """This program's tokens (n, in range, int64), H_pre [BN, SP] and rstd [BN]; the raw logits
    and rstd are stored. The splits are read KB at a time as one [KB, BN, PP] load: decode's few
    tokens come in ~C / BC splits, and one split per loop step would wait out a memory latency
    per split."""
    n, n_ok, n64, p, sq, raw = _token_sums(N, BN, PP)
    kb = tl.arange(0, KB)
    for k0 in range(0, SPLITS, KB):
        row = (k0 + kb)[:, None] * N + n64[None, :]  # [KB, BN]
        ok = ((k0 + kb) < SPLITS)[:, None] & n_ok[None, :]
        part = tl.load(
            part_ptr + row[:, :, None] * PP + p[None, None, :], mask=ok[:, :, None], other=0.0
        )
        raw += tl.sum(part, axis=0)
        sq += tl.sum(tl.load(sq_ptr + row, mask=ok, other=0.0), axis=0)
    # raw goes out (the backward and coeff_rest need it) and comes back in the [pre | post | res]
    # layout the code reads; the barrier makes every thread's stores visible to the program.
    tl.store(raw_ptr + n64[:, None] * P + p[None, :], raw, mask=n_ok[:, None] & (p < P)[None, :])
    tl.debug_barrier()
    rstd = tl.rsqrt(sq / C + f32(norm_eps))
    tl.store(rstd_ptr + n, rstd, mask=n_ok)
    s = tl.arange(0, SP)[None, :]
    vec_ok = n_ok[:, None] & (s < S)
    z_pre = tl.load(raw_ptr + n64[:, None] * P + s, mask=vec_ok, other=0.0) * rstd[:, None]
    a_pre = tl.load(alpha_ptr) * z_pre + tl.load(bias_ptr + s, mask=s < S, other=0.0)
    return n, n_ok, n64, tl.sigmoid(a_pre) + hc_eps, rstd


@triton.jit
def tail_post(
    raw_ptr,
    alpha_ptr,
    bias_ptr,
    post_ptr,
    n64,
    n_ok,
    rstd,
    S: tl.constexpr,
    SP: tl.constexpr,
    P: tl.constexpr,
):
    """H_post = 2 sigmoid of the BN tokens' post logits times rstd -> post_ptr [N, S]."""
    s = tl.arange(0, SP)[None, :]
    vec_ok = n_ok[:, None] & (s < S)
    z_post = tl.load(raw_ptr + n64[:, None] * P + S + s, mask=vec_ok, other=0.0) * rstd[:, None]
    a_post = tl.load(alpha_ptr + 1) * z_post + tl.load(bias_ptr + S + s, mask=s < S, other=0.0)
    tl.store(post_ptr + n64[:, None] * S + s, 2.0 * tl.sigmoid(a_post), mask=vec_ok)


@triton.jit
def _post_res(
    raw_ptr,
    alpha_ptr,
    bias_ptr,
    post_ptr,
    res_ptr,
    n64,
    n_ok,
    rstd,
    hc_eps,
    iters,
    S: tl.constexpr,
    SP: tl.constexpr,
    P: tl.constexpr,
):
    """H_post = 2 sigmoid and H_res = Sinkhorn of the BN tokens' raw logits times rstd."""
    tail_post(raw_ptr, alpha_ptr, bias_ptr, post_ptr, n64, n_ok, rstd, S, SP, P)
    z_res, valid = _res_load(raw_ptr + 2 * S, n64, n_ok, P, S, SP)
    b_res, _ = _res_load(bias_ptr + 2 * S, n64, n_ok, 0, S, SP)
    a_res = tl.load(alpha_ptr + 2) * (z_res * rstd[:, None, None]) + b_res
    m = _state_before(a_res, valid, 2 * iters, hc_eps)
    _res_store(res_ptr, m, n64, n_ok, S * S, S, SP)


@triton.jit
def coeff_bwd(
    raw_ptr,
    rstd_ptr,
    alpha_ptr,
    bias_ptr,
    gpre_ptr,
    gpost_ptr,
    gres_ptr,
    ga_ptr,
    graw_ptr,
    coef_ptr,
    scr_ptr,
    N,
    C,
    hc_eps,
    iters,
    S: tl.constexpr,
    SP: tl.constexpr,
    P: tl.constexpr,
    WITH_RES: tl.constexpr,
    BN: tl.constexpr,
):
    """g_a = dL/d(alpha z + b) [N,P], g_raw = g_a alpha rstd [N,P], and coef [N] with
    dL/dx (through rstd) = coef * x."""
    hc_eps = f32(hc_eps)
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


def _token_block(cfg: Launch, N: int) -> int:
    """CONFIG's BN tokens per program, cut to the few tokens of a decode call (>= 16 rows, what
    tl.dot needs)."""
    return min(int(cfg["BN"]), max(16, pow2(N)))


def _tail_block(cfg: Launch, N: int, SP: int) -> int:
    """coeff_tail's tokens per program: CONFIG's BN for training, down to one for decode (no
    tl.dot), so a decode call gets ~TAIL_PROGRAMS with fewer warps each."""
    bn = min(int(cfg["BN"]), pow2(cdiv(N, TAIL_PROGRAMS)))
    cfg["BN"], cfg["num_warps"] = bn, max(1, min(int(cfg["num_warps"]), bn * SP * SP // 128))
    return bn


TAIL_PROGRAMS = 128


TAIL_ELEMENTS = 4096  # coeff_tail's [KB, BN, PP] load of projection partials, at most


def splits_per_load(splits: int, bn: int, PP: int) -> int:
    """KB: projection splits a [KB, BN, PP] load of the tail reads (TAIL_ELEMENTS at most)."""
    return min(pow2(splits), max(1, TAIL_ELEMENTS // (bn * PP)))


def projection(x_BTSD: Tensor, phi_PC: Tensor, N: int, PP: int) -> tuple[Tensor, Tensor, int]:
    """coeff_proj's partial (projection [splits, N, PP], sum of squares [splits, N], splits):
    the columns are split until the grid has about CONFIG's PROGRAMS programs. PREC "bf16x3"
    needs bf16 streams and phi's bf16 terms; fp16 streams and a served phi take "tf32x3"."""
    C = x_BTSD.shape[-2] * x_BTSD.shape[-1]
    cfg = launch("coeff_proj", x_BTSD, x_BTSD.shape[-2])
    if cfg["PREC"] == "bf16x3" and (x_BTSD.dtype != torch.bfloat16 or is_served(phi_PC)):
        cfg["PREC"] = "tf32x3"
    bn = _token_block(cfg, N)
    bc, blocks = int(cfg.pop("BC")), cdiv(N, bn)
    splits = max(1, min(cdiv(C, bc), int(cfg.pop("PROGRAMS")) // blocks))
    chunk = cdiv(cdiv(C, splits), bc) * bc
    splits = cdiv(C, chunk)
    part = x_BTSD.new_empty((splits, N, PP), dtype=torch.float32)
    sq = x_BTSD.new_empty((splits, N), dtype=torch.float32)
    cfg["BN"] = bn
    phi_t = projection_phi(phi_PC, 3 if cfg["PREC"] == "bf16x3" else 1)
    traceable(coeff_proj)[(blocks, splits)](
        x_BTSD, phi_t, part, sq, N, C, chunk, PP=PP, BC=bc, EMU=INTERPRET, **cfg
    )
    return part, sq, splits


def _coefficients_impl(
    x_BTSD: Tensor,
    phi_PC: Tensor,
    alpha: Tensor,
    bias_P: Tensor,
    iters: int,
    with_res: bool,
    with_mix: bool,
    norm_eps: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(H_pre, H_post, H_res, y = sum_j H_pre[j] x_j if with_mix, raw logits, rstd); the last two
    are saved for the backward."""
    pre, post, res, y_BTD, raw_BTP, rstd = coefficient_buffers(x_BTSD, phi_PC, with_res, with_mix)
    S, D = x_BTSD.shape[-2:]
    N, C, P = rstd.numel(), S * D, phi_PC.shape[0]
    (SP, PP), cfg = pads(S, P), launch("coeff_tail", x_BTSD, S)
    if N:
        part, sq, splits = projection(x_BTSD, phi_PC, N, PP)
        bn = _tail_block(cfg, N, SP)
        kb = splits_per_load(splits, bn, PP)
        traceable(coeff_tail)[(cdiv(N, bn),)](
            part,
            sq,
            raw_BTP,
            alpha,
            bias_P,
            pre,
            post,
            res,
            rstd,
            N,
            C,
            splits,
            norm_eps,
            eps,
            iters,
            S=S,
            SP=SP,
            P=P,
            PP=PP,
            WITH_RES=with_res,
            KB=kb,
            **cfg,
        )
    if N and with_mix:
        mix_in_into(y_BTD, x_BTSD, pre)
    return pre, post, res, y_BTD, raw_BTP, rstd


def _output_specs(
    x_BTSD: Tensor, phi_PC: Tensor, with_res: bool, with_mix: bool
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of the coefficient op's outputs: fp32 but y (H_post, H_res, y of shape [0]
    when not computed)."""
    lead, (S, D), f32 = tuple(x_BTSD.shape[:-2]), x_BTSD.shape[-2:], torch.float32
    return [
        ((*lead, S), f32),
        ((*lead, S) if with_res else (0,), f32),
        ((*lead, S, S) if with_res else (0,), f32),
        ((*lead, D) if with_mix else (0,), x_BTSD.dtype),
        ((*lead, phi_PC.shape[0]), f32),
        (lead, f32),
    ]


def coefficient_buffers(
    x_BTSD: Tensor, phi_PC: Tensor, with_res: bool, with_mix: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Empty outputs (`_output_specs`)."""
    specs = _output_specs(x_BTSD, phi_PC, with_res, with_mix)
    return tuple(x_BTSD.new_empty(shape, dtype=dtype) for shape, dtype in specs)  # type: ignore[return-value]


def _coefficients_fake_op(x_BTSD, phi_PC, alpha, bias_P, iters, with_res, with_mix, norm_eps, eps):  # type: ignore[no-untyped-def]
    return coefficient_buffers(x_BTSD, phi_PC, with_res, with_mix)


coefficients_op = FusedOp("mhc_coefficients", _coefficients_impl, _coefficients_fake_op)


def _coefficients_bwd_impl(
    g_pre: Tensor,
    g_post: Tensor,
    g_res: Tensor,
    g_y: Tensor,
    g_r: Tensor,
    x_BTSD: Tensor,
    phi_PC: Tensor,
    pre: Tensor,
    raw_BTP: Tensor,
    rstd_BT: Tensor,
    alpha: Tensor,
    bias_P: Tensor,
    iters: int,
    with_res: bool,
    eps: float,
    mix_reduced: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(g_x, g_phi, g_a: the gradient of the pre-activations alpha z + b). g_y: the gradient of
    the mix in (shape [0] if the op did not mix in); g_pre of shape [0] with a mix in: H_pre's
    gradient is the mix in's term alone; mix_reduced: g_pre already holds it (the caller
    reduced <g_y, x_j>); g_r: x's gradient from mix out's residual path (shape [0] if not
    handed over). g_y and g_r join the one write of g_x."""
    if g_r.numel() and g_r.shape != x_BTSD.shape:
        raise ValueError(f"g_r has shape {tuple(g_r.shape)}, x {tuple(x_BTSD.shape)}")
    S, D = x_BTSD.shape[-2:]
    N, C, P = rstd_BT.numel(), S * D, phi_PC.shape[0]
    g_raw, g_a = torch.empty_like(raw_BTP), torch.empty_like(raw_BTP)
    coef_BT = torch.empty_like(rstd_BT)
    g_x = torch.empty_like(x_BTSD)
    if not N:
        return g_x, torch.zeros_like(phi_PC), g_a
    mix, res = g_y.numel() > 0, g_r.numel() > 0
    if (
        mix and not mix_reduced
    ):  # H_pre also reached the loss through y: g_pre += <g_y, x_j> (g_pre [0]: zero)
        g_mix = mix_in_weight_grad(g_y, x_BTSD, pre)
        g_pre = g_pre + g_mix if g_pre.numel() else g_mix
    (SP, _), cfg = pads(S, P), launch("coeff_bwd", x_BTSD, S)
    scratch = raw_BTP.new_empty((N, 2 * iters, SP) if with_res else (1,))  # Sinkhorn denominators
    traceable(coeff_bwd)[(cdiv(N, int(cfg["BN"])),)](
        raw_BTP,
        rstd_BT,
        alpha,
        bias_P,
        g_pre,
        g_post,
        g_res,
        g_a,
        g_raw,
        coef_BT,
        scratch,
        N,
        C,
        eps,
        iters,
        S=S,
        SP=SP,
        P=P,
        WITH_RES=with_res,
        **cfg,
    )
    g_phi = projection_grads(
        g_raw, phi_PC, x_BTSD, coef_BT, g_x, g_y if mix else None, pre, g_r if res else None
    )
    return g_x, g_phi, g_a


def _coefficients_bwd_fake(g_pre, g_post, g_res, g_y, g_r, x_BTSD, phi_PC, pre, raw_BTP, *_):  # type: ignore[no-untyped-def]  # noqa: E501
    return torch.empty_like(x_BTSD), torch.empty_like(phi_PC), torch.empty_like(raw_BTP)


_coefficients_bwd_op = FusedOp(
    "mhc_coefficients_bwd", _coefficients_bwd_impl, _coefficients_bwd_fake
)


def save_coefficients(ctx, inputs, output, *extra) -> None:  # type: ignore[no-untyped-def]
    """Save what `coefficient_grads` reads (the first seven saved tensors), then `extra`."""
    x_BTSD, phi_PC, alpha, bias_P, iters, with_res, with_mix, _norm_eps, eps = inputs
    pre, _, _, _, raw_BTP, rstd_BT = output
    ctx.save_for_backward(x_BTSD, phi_PC, pre, raw_BTP, rstd_BT, alpha, bias_P, *extra)
    ctx.hyper = (iters, with_res, with_mix, eps)


def _coefficients_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    save_coefficients(ctx, inputs, output)
    ctx.mark_non_differentiable(*output[4:])  # raw logits, rstd


def coefficient_grads(  # type: ignore[no-untyped-def]
    saved, hyper, g_pre, g_post, g_res, g_y, g_r, *, mix_reduced: bool = False
):
    """(g_x, g_phi, g_alpha, g_bias) from the outputs' gradients (None: zero) and what
    `save_coefficients` kept (`saved`: its first seven tensors, `hyper`: ctx.hyper); g_r: x's
    gradient from mix out's residual path, added into g_x (None: nothing); mix_reduced: see
    `_coefficients_bwd_impl`."""
    x_BTSD, phi_PC, pre, raw_BTP, rstd_BT, alpha, bias_P = saved
    iters, with_res, with_mix, eps = hyper
    specs = _output_specs(x_BTSD, phi_PC, with_res, with_mix)
    if g_pre is None and with_mix and g_y is not None:
        # H_pre's gradient from the mix in alone needs no zeros to add to (shape [0]: the
        # backward takes the mix in's term as all of it)
        g_pre = x_BTSD.new_empty((0,), dtype=torch.float32)
    # an output without a gradient contributes zero
    g_pre, g_post, g_res, g_y = (
        g.contiguous() if g is not None else x_BTSD.new_zeros(shape, dtype=dtype)
        for g, (shape, dtype) in zip((g_pre, g_post, g_res, g_y), specs[:4], strict=True)
    )
    g_r = x_BTSD.new_empty((0,)) if g_r is None else g_r.contiguous()
    g_x, g_phi, g_a = _coefficients_bwd_op(
        g_pre,
        g_post,
        g_res,
        g_y,
        g_r,
        x_BTSD,
        phi_PC,
        pre,
        raw_BTP,
        rstd_BT,
        alpha,
        bias_P,
        iters,
        with_res,
        eps,
        mix_reduced,
    )
    # alpha scales each slice of z = raw * rstd: g_alpha[i] = sum over tokens and slice of g_a z.
    P, S = raw_BTP.shape[-1], x_BTSD.shape[-2]
    gz_P = (g_a * raw_BTP * rstd_BT[..., None]).reshape(-1, P).sum(0)
    sizes = [S, S, S * S] if with_res else [S]
    g_alpha = torch.stack([part.sum() for part in gz_P.split(sizes)])
    return g_x, g_phi, g_alpha, g_a.reshape(-1, P).sum(0)


def _coefficients_backward(ctx, g_pre, g_post, g_res, g_y, _g_raw, _g_rstd):  # type: ignore[no-untyped-def]
    grads = coefficient_grads(ctx.saved_tensors, ctx.hyper, g_pre, g_post, g_res, g_y, None)
    return *grads, None, None, None, None, None


coefficients_op.register_autograd(_coefficients_backward, setup_context=_coefficients_setup)


class _CoefficientsMixInStreams(torch.autograd.Function):
    """The coefficient op with the mix in, whose node also gives x back, as a view (a custom
    op's outputs may not alias its inputs, and a copy would cost more than the add it saves).
    A mix out that reads this view sends its g_x here, into the op's one write of g_x."""

    @staticmethod
    def forward(ctx, x_BTSD, phi_PC, alpha, bias_P, iters, norm_eps, eps):  # type: ignore[no-untyped-def]
        inputs = (x_BTSD, phi_PC, alpha, bias_P, iters, True, True, norm_eps, eps)
        pre, post, res, y_BTD, raw_BTP, rstd_BT = coefficients_op(*inputs)
        save_coefficients(ctx, inputs, (pre, post, res, y_BTD, raw_BTP, rstd_BT))
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros
        return y_BTD, pre, post, res, x_BTSD.view_as(x_BTSD)

    @staticmethod
    def backward(ctx, g_y, g_pre, g_post, g_res, g_r):  # type: ignore[no-untyped-def]
        grads = coefficient_grads(ctx.saved_tensors, ctx.hyper, g_pre, g_post, g_res, g_y, g_r)
        return *grads, None, None, None


def op_inputs(
    x_BTSD: Tensor, phi_PC: Tensor, alpha: Tensor, bias_P: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The coefficient op's tensor inputs as its kernels read them: checked, contiguous (phi
    also in `served_phi`'s layout), alpha and bias in fp32."""
    check_inputs(x_BTSD, phi_PC)
    return (
        x_BTSD.contiguous(),
        phi_PC if is_served(phi_PC) else phi_PC.contiguous(),
        alpha.float().contiguous(),
        bias_P.float().contiguous(),
    )


def _coefficients(
    x_BTSD: Tensor,
    phi_PC: Tensor,
    alpha: Tensor,
    bias_P: Tensor,
    iters: int,
    with_res: bool,
    with_mix: bool,
    norm_eps: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    inputs = op_inputs(x_BTSD, phi_PC, alpha, bias_P)
    pre, post, res, y, _, _ = coefficients_op(*inputs, iters, with_res, with_mix, norm_eps, eps)
    return pre, post, res, y


def mhc_coefficients(
    x_BTSD: Tensor,
    phi_PC: Tensor,
    alpha_3: Tensor,
    bias_P: Tensor,
    *,
    iters: int,
    norm_eps: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fused (H_pre [B,T,S], H_post [B,T,S], H_res [B,T,S,S]) in fp32."""
    pre, post, res, _ = _coefficients(
        x_BTSD, phi_PC, alpha_3, bias_P, iters, True, False, norm_eps, eps
    )
    return pre, post, res


def coefficients_and_mix_in(
    x_BTSD: Tensor,
    phi_PC: Tensor,
    alpha_3: Tensor,
    bias_P: Tensor,
    *,
    iters: int,
    norm_eps: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fused (sum_j H_pre[j] x_j [B,T,D], H_pre, H_post, H_res) as one op: its backward writes
    g_x once for the coefficients and the mix in (one [B,T,S,D] write and add fewer)."""
    pre, post, res, y = _coefficients(
        x_BTSD, phi_PC, alpha_3, bias_P, iters, True, True, norm_eps, eps
    )
    return y, pre, post, res


def coefficients_and_mix_in_streams(
    x_BTSD: Tensor,
    phi_PC: Tensor,
    alpha_3: Tensor,
    bias_P: Tensor,
    *,
    iters: int,
    norm_eps: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`coefficients_and_mix_in` and the streams again, [B,T,S,D], for `mix_out` to read: a view
    of x from the same autograd node, so the op's backward adds mix out's g_x (H_res g_y) into
    its one write of g_x, and autograd sums no gradients for x."""
    inputs = op_inputs(x_BTSD, phi_PC, alpha_3, bias_P)
    return _CoefficientsMixInStreams.apply(*inputs, iters, norm_eps, eps)  # type: ignore[no-any-return]


def contraction_weights(
    x_BTSD: Tensor, phi_SC: Tensor, alpha_1: Tensor, bias_S: Tensor, *, norm_eps: float, eps: float
) -> Tensor:
    """Fused sigmoid weights [B,T,S] of the output contraction (the H_pre path alone)."""
    return _coefficients(x_BTSD, phi_SC, alpha_1, bias_S, 0, False, False, norm_eps, eps)[0]


def contract(
    x_BTSD: Tensor, phi_SC: Tensor, alpha_1: Tensor, bias_S: Tensor, *, norm_eps: float, eps: float
) -> Tensor:
    """Fused output contraction sum_s w_s x_s [B,T,D] (weights and sum as one op)."""
    return _coefficients(x_BTSD, phi_SC, alpha_1, bias_S, 0, False, True, norm_eps, eps)[3]
