"""The engine's fused mHC entries and exit, forward only: the coefficients, the mix in and the
RMSNorm that follows it as one launch after the projection, with H_post and H_res on another
stream; and mix out with the next entry's projection.

Legend: A active rows, T tokens (any leading shape works), S streams, D model dim, P logits.

All are forward-only custom ops (`birkhoff::mhc_entry`, `birkhoff::mhc_entry_rest`,
`birkhoff::mhc_exit`). In a decode step every sublayer's coefficients are a chain of small
launches on the critical path, each mostly latency. Three things shorten it:
- H_pre alone gates the sublayer's input; H_post and H_res (the 2 t_max-step Sinkhorn, most of
  the coefficients' latency at decode sizes) are read only by mix out, after F. `hyper_entry`
  launches them (`coeff_rest`, from the raw logits and rstd the entry stored) on a stream the
  caller passes and joins before mix out; in a CUDA graph capture the fork and join become
  graph edges, so a replay runs the Sinkhorn beside the sublayer's attention or MLP.
- `pre_mix_norm` sums the projection's partials, computes H_pre, mixes the streams in and
  applies the sublayer's RMSNorm, one program per few tokens over all D columns: the tail, mix
  in and norm launches of the training ops in one. The output contraction and the final norm
  (`contract_norm`) take the same kernel.
- `mix_out_proj` writes the new streams and, from them as stored, the partials of the next
  entry's projection (per 16-column block, exact fp32 products), which that entry then sums
  instead of running coeff_proj: one pass over the streams where two were.
Values: the same arithmetic as the training ops' launches (coeff_tail, mix_in_fwd,
rms_norm_fwd, mix_out_fwd), bit for bit under the interpreter, except that the exit's
projection sums in another order than coeff_proj (raw logits within 2e-6 of their scale);
compiled, a kernel's reductions may run in another order (H_res within ~1e-7, the normed input
within two ulps at its scale; tests/kernels).
coeff_rest holds a token a thread (`mhc_rest_triton`): its tiled form's cross-thread sums made
it long enough to slow the GEMMs it ran beside; a step's tokens run as one program of up to
REST_WARPS warps, on one SM (docs/results.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import mhc_mix_triton as M
from birkhoff.kernels import mhc_rest_triton as R
from birkhoff.kernels import mhc_triton as K
from birkhoff.kernels.mhc import (
    _coefficients_fake,
    _op_inputs,
    _pads,
    _projection,
    _splits_per_load,
)
from birkhoff.kernels.mhc_configs import CONFIG
from birkhoff.kernels.mhc_mix import cdiv, check_inputs, pad_streams, pow2
from birkhoff.kernels.mhc_phi import padded_logits, projection_phi

REST_WARPS = 8  # coeff_rest: a decode step's 256 tokens on one SM
ENTRY_ELEMENTS = 4096  # pre_mix_norm's [BN, BD] tile of one stream, at most


@torch.library.custom_op("birkhoff::mhc_entry", mutates_args=())
def pre_mix_norm(
    x_ATSD: Tensor, phi_PC: Tensor, alpha: Tensor, bias_P: Tensor, weight_D: Tensor,
    norm_eps: float, eps: float, rms_eps: float, part: Tensor | None = None,
    sq: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(RMSNorm(sum_j H_pre[j] x_j) * weight [A,T,D] in x's dtype, raw logits [A,T,P] and rstd
    [A,T] in fp32) for contiguous x, phi as `mhc` takes it, fp32 alpha and bias. `part` and
    `sq`: x's projection partials from `mix_out_proj` (None: coeff_proj computes them)."""
    check_inputs(x_ATSD, phi_PC, weight_D)
    (S, D), P = x_ATSD.shape[-2:], phi_PC.shape[0]
    if tuple(weight_D.shape) != (D,):
        raise ValueError(f"mhc_entry: norm weight of shape {tuple(weight_D.shape)}, streams of "
                         f"dim {D}")  # fmt: skip
    (SP, PP), BD = _pads(S, P), max(16, pow2(D))
    _, _, _, y_ATD, raw_ATP, rstd = _coefficients_fake(x_ATSD, phi_PC, False, True)
    N = rstd.numel()
    if (part is None) != (sq is None):
        raise ValueError("mhc_entry: pass both projection partials part and sq, or neither")
    if part is not None and sq is not None:
        if part.shape[1:] != (N, PP) or tuple(sq.shape) != part.shape[:2]:
            raise ValueError(f"mhc_entry: projection partials {tuple(part.shape)} / "
                             f"{tuple(sq.shape)} for {N} tokens and {P} logits")  # fmt: skip
        splits = part.shape[0]
    elif N:
        part, sq, splits = _projection(x_ATSD, phi_PC, N, PP)
    if N:
        launch = CONFIG["pre_mix_norm"]
        bn = max(1, min(pow2(cdiv(N, int(launch["PROGRAMS"]))), ENTRY_ELEMENTS // BD))
        kb = _splits_per_load(splits, bn, PP)
        K.pre_mix_norm[(cdiv(N, bn),)](
            part, sq, x_ATSD, weight_D.contiguous(), alpha, bias_P, raw_ATP, rstd, y_ATD,
            N, D, splits, norm_eps, eps, rms_eps, S=S, SP=SP, P=P, PP=PP, KB=kb, BN=bn, BD=BD,
            num_warps=int(launch["num_warps"]),
        )  # fmt: skip
    return y_ATD, raw_ATP, rstd


@pre_mix_norm.register_fake
def _(x_ATSD, phi_PC, alpha, bias_P, weight_D, norm_eps, eps, rms_eps, part=None, sq=None):  # type: ignore[no-untyped-def]  # noqa: E501
    return _coefficients_fake(x_ATSD, phi_PC, False, True)[3:]


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
        M.mix_out_proj[(cdiv(N, cfg["BN"]), sq.shape[0])](
            x_ATSD, f_ATD, post_ATS, res_ATSS, y_ATSD, projection_phi(phi_PC, 1), part, sq, N, D,
            S=S, PP=PP, **cfg,
        )  # fmt: skip
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
    raw_ATP: Tensor, rstd: Tensor, alpha: Tensor, bias_P: Tensor, post_ATS: Tensor,
    res_ATSS: Tensor, iters: int, eps: float,
) -> None:  # fmt: skip
    """H_post and H_res (fp32, contiguous) from `pre_mix_norm`'s raw logits and rstd."""
    N, S = rstd.numel(), post_ATS.shape[-1]
    if N:
        cfg = _rest_launch(N)
        R.coeff_rest[(cdiv(N, cfg["BN"]),)](
            raw_ATP, rstd, alpha, bias_P, post_ATS, res_ATSS, N, eps, iters, S=S,
            SP=pad_streams(S), P=raw_ATP.shape[-1], **cfg,
        )  # fmt: skip


def _rest_launch(N: int) -> dict[str, int]:
    """coeff_rest's launch for N tokens: a token a thread, up to REST_WARPS warps a program
    (a decode step's tokens on one SM, taken from the sublayer beside it)."""
    warps = min(REST_WARPS, pow2(cdiv(N, 32)))
    return dict(BN=32 * warps, num_warps=warps)


def hyper_entry(
    x_ATSD: Tensor, phi_PC: Tensor, alpha_3: Tensor, bias_P: Tensor, weight_D: Tensor, *,
    iters: int, norm_eps: float, eps: float, rms_eps: float, stream: torch.cuda.Stream | None,
    proj: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple[Tensor, ...]]:  # fmt: skip
    """(x as read, the sublayer's input RMSNorm(sum_j H_pre[j] x_j) * weight, H_post, H_res,
    what `stream` reads). H_post and H_res are computed on `stream` (None: the current one):
    the caller joins it before reading them and holds the last output until then. `proj`: x's
    projection partials, from the `mix_out_proj` that wrote x."""
    x_ATSD, phi_PC, alpha, bias_P = _op_inputs(x_ATSD, phi_PC, alpha_3, bias_P)
    y_ATD, raw_ATP, rstd = pre_mix_norm(
        x_ATSD, phi_PC, alpha, bias_P, weight_D, norm_eps, eps, rms_eps, *(proj or (None, None))
    )
    # made here, on the current stream (allocations on `stream` inside a CUDA graph capture
    # invalidated the capture in a GPU test)
    _, post, res, _, _, _ = _coefficients_fake(x_ATSD, phi_PC, True, False)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(x_ATSD.device))
    with torch.cuda.stream(stream):  # None: the current stream
        post_res(raw_ATP, rstd, alpha, bias_P, post, res, iters, eps)
    return x_ATSD, y_ATD, post, res, (raw_ATP, rstd, alpha, bias_P)


def contract_norm(
    x_ATSD: Tensor, phi_SC: Tensor, alpha_1: Tensor, bias_S: Tensor, weight_D: Tensor, *,
    norm_eps: float, eps: float, rms_eps: float, proj: tuple[Tensor, Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """RMSNorm(sum_s w_s x_s) * weight [A,T,D]: the output contraction and the final norm."""
    inputs = _op_inputs(x_ATSD, phi_SC, alpha_1, bias_S)
    return pre_mix_norm(*inputs, weight_D, norm_eps, eps, rms_eps, *(proj or (None, None)))[0]
