"""The engine's forward-only mHC sublayer entry and exit, and its H_post / H_res kernel.

Legend: A rows, T tokens (N = A*T), S streams (SP: padded), D model dim, C = S*D, P = S*S + 2S
logits (PP: padded).

- `pre_mix_norm` (entry): H_pre, the mix in and the sublayer's RMSNorm in one launch, storing
  the raw logits and rstd; `hyper_entry` wraps it, `contract_norm` does the same for the output
  contraction.
- `post_res` / `coeff_rest`: H_post and H_res from those logits, one token a thread (every sum
  in one thread's registers), on a side stream beside the sublayer's GEMMs.
- `mix_out_proj` (exit): mix out plus the next sublayer's projection of the new streams.
Values: the training kernels' arithmetic, operation for operation (bit for bit in the interpreter).
"""

# mypy: disable-error-code="assignment, misc"
# (mypy cannot follow coeff_rest's tuple that grows one entry per unrolled step)

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import cdiv, check_inputs, pow2, tl, triton
from birkhoff.kernels.mhc.coefficients import (
    coefficient_buffers,
    f32,
    op_inputs,
    projection,
    splits_per_load,
    tail_post,
    tail_pre,
)
from birkhoff.kernels.mhc.configs import CONFIG, pad_streams, padded_logits, pads
from birkhoff.kernels.mhc.mixes import mix_out_stream, tile
from birkhoff.kernels.mhc.phi import projection_phi


@triton.jit
def pre_mix_norm_kernel(
    part_ptr,
    sq_ptr,
    x_ptr,
    w_ptr,
    alpha_ptr,
    bias_ptr,
    raw_ptr,
    rstd_ptr,
    y_ptr,
    N,
    D,
    SPLITS,
    norm_eps,
    hc_eps,
    rms_eps,
    S: tl.constexpr,
    SP: tl.constexpr,
    P: tl.constexpr,
    PP: tl.constexpr,
    KB: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """The engine's sublayer entry over all D columns of BN tokens a program: coeff_tail's H_pre
    (raw logits and rstd stored, for coeff_rest), y = sum_j H_pre[j] x_j rounded to y's dtype
    as mix_in_fwd's, then RMSNorm(y) * w as rms_norm_fwd's -> y_ptr [N, D]."""
    n, n_ok, n64, h_pre, _ = tail_pre(
        part_ptr,
        sq_ptr,
        raw_ptr,
        rstd_ptr,
        alpha_ptr,
        bias_ptr,
        N,
        S * D,
        SPLITS,
        norm_eps,
        f32(hc_eps),
        S,
        SP,
        P,
        PP,
        BN,
        KB,
    )
    d = tl.arange(0, BD)
    ok = n_ok[:, None] & (d < D)[None, :]
    s = tl.arange(0, SP)[None, :]
    y = tl.zeros([BN, BD], dtype=tl.float32)
    for j in tl.static_range(S):
        h = tl.sum(tl.where(s == j, h_pre, 0.0), axis=1)  # column j, exactly
        xj = tl.load(x_ptr + n64[:, None] * (S * D) + j * D + d[None, :], mask=ok, other=0.0)
        y += h[:, None] * xj.to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
    y = y * tl.rsqrt(tl.sum(y * y, axis=1) / D + f32(rms_eps))[:, None]
    y = y * tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + n64[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def mix_out_proj_kernel(
    x_ptr,
    f_ptr,
    post_ptr,
    res_ptr,
    y_ptr,
    phit_ptr,
    part_ptr,
    sq_ptr,
    N,
    D,
    S: tl.constexpr,
    PP: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    """mix_out_fwd's arithmetic, and over the new streams as stored, the next sublayer's
    coefficient projection on this tile's S*BD columns: part [ND, N, PP] (y @ phi^T with exact
    fp32 products, fp32 phit [C, PP]) and sq [ND, N] (sum of squares), coeff_proj's partials
    with the D blocks as splits. Narrow tiles (BD 16): the dots stay few registers, and
    decode's few tokens still get ~D / 16 programs."""
    n64, n_ok, d, ok = tile(N, D, BN, BD)
    row = n64[:, None] * (S * D) + d[None, :]
    f = tl.load(f_ptr + n64[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    p = tl.arange(0, PP)
    sq = tl.zeros([BN], dtype=tl.float32)
    raw = tl.zeros([BN, PP], dtype=tl.float32)
    for k in tl.static_range(S):
        yv = mix_out_stream(
            x_ptr, f, post_ptr, res_ptr, y_ptr, n64, n_ok, row, ok, k, S, D, BN, BD
        )  # zero outside the tile: every load there reads 0
        sq += tl.sum(yv * yv, axis=1)
        phi_t = tl.load(
            phit_ptr + (k * D + d)[:, None] * PP + p[None, :], mask=(d < D)[:, None], other=0.0
        )
        raw = tl.dot(yv, phi_t, raw, input_precision="ieee")
    split = tl.program_id(1).to(tl.int64) * N + n64
    tl.store(part_ptr + split[:, None] * PP + p[None, :], raw, mask=n_ok[:, None])
    tl.store(sq_ptr + split, sq, mask=n_ok)


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
    raw_ptr,
    rstd_ptr,
    alpha_ptr,
    bias_ptr,
    post_ptr,
    res_ptr,
    N,
    hc_eps,
    iters,
    S: tl.constexpr,
    SP: tl.constexpr,
    P: tl.constexpr,
    BN: tl.constexpr,
):
    """H_post [N, S] and H_res [N, S, S] (fp32) from the raw logits [N, P] and rstd [N] that
    pre_mix_norm (or coeff_tail without them) stored."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = n < N
    n64 = n.to(tl.int64)
    hc_eps = f32(hc_eps)
    rstd = tl.load(rstd_ptr + n, mask=n_ok, other=0.0)
    tail_post(raw_ptr, alpha_ptr, bias_ptr, post_ptr, n64, n_ok, rstd, S, SP, P)
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


REST_WARPS = 8  # coeff_rest: a decode step's 256 tokens on one SM


ENTRY_ELEMENTS = 4096  # pre_mix_norm's [BN, BD] tile of one stream, at most


@torch.library.custom_op("birkhoff::mhc_entry", mutates_args=())
def pre_mix_norm(
    x_ATSD: Tensor,
    phi_PC: Tensor,
    alpha: Tensor,
    bias_P: Tensor,
    weight_D: Tensor,
    norm_eps: float,
    eps: float,
    rms_eps: float,
    part: Tensor | None = None,
    sq: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(RMSNorm(sum_j H_pre[j] x_j) * weight [A,T,D] in x's dtype, raw logits [A,T,P] and rstd
    [A,T] in fp32) for contiguous x, phi as `mhc` takes it, fp32 alpha and bias. `part` and
    `sq`: x's projection partials from `mix_out_proj` (None: coeff_proj computes them)."""
    check_inputs(x_ATSD, phi_PC, weight_D)
    (S, D), P = x_ATSD.shape[-2:], phi_PC.shape[0]
    if tuple(weight_D.shape) != (D,):
        raise ValueError(
            f"mhc_entry: norm weight of shape {tuple(weight_D.shape)}, streams of dim {D}"
        )
    (SP, PP), BD = pads(S, P), max(16, pow2(D))
    _, _, _, y_ATD, raw_ATP, rstd = coefficient_buffers(x_ATSD, phi_PC, False, True)
    N = rstd.numel()
    if (part is None) != (sq is None):
        raise ValueError("mhc_entry: pass both projection partials part and sq, or neither")
    if part is not None and sq is not None:
        if part.shape[1:] != (N, PP) or tuple(sq.shape) != part.shape[:2]:
            raise ValueError(
                f"mhc_entry: projection partials {tuple(part.shape)} / "
                f"{tuple(sq.shape)} for {N} tokens and {P} logits"
            )
        splits = part.shape[0]
    elif N:
        part, sq, splits = projection(x_ATSD, phi_PC, N, PP)
    if N:
        launch = CONFIG["pre_mix_norm"]
        bn = max(1, min(pow2(cdiv(N, int(launch["PROGRAMS"]))), ENTRY_ELEMENTS // BD))
        kb = splits_per_load(splits, bn, PP)
        pre_mix_norm_kernel[(cdiv(N, bn),)](
            part,
            sq,
            x_ATSD,
            weight_D.contiguous(),
            alpha,
            bias_P,
            raw_ATP,
            rstd,
            y_ATD,
            N,
            D,
            splits,
            norm_eps,
            eps,
            rms_eps,
            S=S,
            SP=SP,
            P=P,
            PP=PP,
            KB=kb,
            BN=bn,
            BD=BD,
            num_warps=int(launch["num_warps"]),
        )
    return y_ATD, raw_ATP, rstd


@pre_mix_norm.register_fake
def _(x_ATSD, phi_PC, alpha, bias_P, weight_D, norm_eps, eps, rms_eps, part=None, sq=None):  # type: ignore[no-untyped-def]  # noqa: E501
    return coefficient_buffers(x_ATSD, phi_PC, False, True)[3:]


def _exit_launch(N: int, D: int) -> dict[str, int]:
    """mix_out_proj's launch parameters for N tokens: CONFIG's, BD cut to D (its D blocks are the
    splits), BN doubled to 32 at most while the grid has more than CONFIG's PROGRAMS."""
    cfg = {k: int(v) for k, v in CONFIG["mix_out_proj"].items()}
    cfg["BD"] = min(cfg["BD"], max(16, pow2(D)))
    programs = cfg.pop("PROGRAMS")
    while cfg["BN"] < 32 and cdiv(N, cfg["BN"]) * cdiv(D, cfg["BD"]) > programs:
        cfg["BN"] *= 2
    return cfg


@torch.library.custom_op("birkhoff::mhc_exit", mutates_args=())
def mix_out_proj(
    x_ATSD: Tensor, f_ATD: Tensor, post_ATS: Tensor, res_ATSS: Tensor, phi_PC: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(mix out's new streams, as `mhc.mix_out`; and their projection partials [ND, N, PP] and
    sums of squares [ND, N] for the next entry, whose coefficients `phi_PC` takes): one pass
    over the streams where mix out and the next coeff_proj made two."""
    check_inputs(x_ATSD, f_ATD)
    S, D = x_ATSD.shape[-2:]
    if phi_PC.shape[1] != S * D:
        raise ValueError(f"mhc_exit: phi of shape {tuple(phi_PC.shape)}, streams [.., {S}, {D}]")
    x_ATSD, f_ATD = x_ATSD.contiguous(), f_ATD.contiguous()  # as mhc.mix_out reads them
    post_ATS, res_ATSS = post_ATS.float().contiguous(), res_ATSS.float().contiguous()
    y_ATSD, part, sq = _mix_out_proj_fake(x_ATSD, f_ATD, post_ATS, res_ATSS, phi_PC)
    N, PP = sq.shape[1], part.shape[-1]
    if N:
        cfg = _exit_launch(N, D)
        mix_out_proj_kernel[(cdiv(N, cfg["BN"]), sq.shape[0])](
            x_ATSD,
            f_ATD,
            post_ATS,
            res_ATSS,
            y_ATSD,
            projection_phi(phi_PC, 1),
            part,
            sq,
            N,
            D,
            S=S,
            PP=PP,
            **cfg,
        )
    return y_ATSD, part, sq


@mix_out_proj.register_fake
def _mix_out_proj_fake(x_ATSD, f_ATD, post_ATS, res_ATSS, phi_PC):  # type: ignore[no-untyped-def]
    (S, D), PP = x_ATSD.shape[-2:], padded_logits(phi_PC.shape[0])
    N = post_ATS.numel() // S
    ND = cdiv(D, _exit_launch(N, D)["BD"])
    y_ATSD = torch.empty_like(x_ATSD, dtype=torch.promote_types(x_ATSD.dtype, f_ATD.dtype))
    part = x_ATSD.new_empty((ND, N, PP), dtype=torch.float32)
    return y_ATSD, part, x_ATSD.new_empty((ND, N), dtype=torch.float32)


@torch.library.custom_op("birkhoff::mhc_entry_rest", mutates_args=("post_ATS", "res_ATSS"))
def post_res(
    raw_ATP: Tensor,
    rstd: Tensor,
    alpha: Tensor,
    bias_P: Tensor,
    post_ATS: Tensor,
    res_ATSS: Tensor,
    iters: int,
    eps: float,
) -> None:
    """H_post and H_res (fp32, contiguous) from `pre_mix_norm`'s raw logits and rstd."""
    N, S = rstd.numel(), post_ATS.shape[-1]
    if N:
        cfg = _rest_launch(N)
        coeff_rest[(cdiv(N, cfg["BN"]),)](
            raw_ATP,
            rstd,
            alpha,
            bias_P,
            post_ATS,
            res_ATSS,
            N,
            eps,
            iters,
            S=S,
            SP=pad_streams(S),
            P=raw_ATP.shape[-1],
            **cfg,
        )


def _rest_launch(N: int) -> dict[str, int]:
    """coeff_rest's launch for N tokens: a token a thread, up to REST_WARPS warps a program
    (a decode step's tokens on one SM, taken from the sublayer beside it)."""
    warps = min(REST_WARPS, pow2(cdiv(N, 32)))
    return dict(BN=32 * warps, num_warps=warps)


def hyper_entry(
    x_ATSD: Tensor,
    phi_PC: Tensor,
    alpha_3: Tensor,
    bias_P: Tensor,
    weight_D: Tensor,
    *,
    iters: int,
    norm_eps: float,
    eps: float,
    rms_eps: float,
    stream: torch.cuda.Stream | None,
    proj: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[Tensor, ...]]:
    """(x as read, the sublayer's input RMSNorm(sum_j H_pre[j] x_j) * weight, H_post, H_res,
    what `stream` reads). H_post and H_res are computed on `stream` (None: the current one):
    the caller joins it before reading them and holds the last output until then. `proj`: x's
    projection partials, from the `mix_out_proj` that wrote x."""
    x_ATSD, phi_PC, alpha, bias_P = op_inputs(x_ATSD, phi_PC, alpha_3, bias_P)
    y_ATD, raw_ATP, rstd = pre_mix_norm(
        x_ATSD, phi_PC, alpha, bias_P, weight_D, norm_eps, eps, rms_eps, *(proj or (None, None))
    )
    # made here, on the current stream (allocations on `stream` inside a CUDA graph capture
    # invalidated the capture in a GPU test)
    _, post, res, _, _, _ = coefficient_buffers(x_ATSD, phi_PC, True, False)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(x_ATSD.device))
    with torch.cuda.stream(stream):  # None: the current stream
        post_res(raw_ATP, rstd, alpha, bias_P, post, res, iters, eps)
    return x_ATSD, y_ATD, post, res, (raw_ATP, rstd, alpha, bias_P)


def contract_norm(
    x_ATSD: Tensor,
    phi_SC: Tensor,
    alpha_1: Tensor,
    bias_S: Tensor,
    weight_D: Tensor,
    *,
    norm_eps: float,
    eps: float,
    rms_eps: float,
    proj: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """RMSNorm(sum_s w_s x_s) * weight [A,T,D]: the output contraction and the final norm."""
    inputs = op_inputs(x_ATSD, phi_SC, alpha_1, bias_S)
    return pre_mix_norm(*inputs, weight_D, norm_eps, eps, rms_eps, *(proj or (None, None)))[0]
