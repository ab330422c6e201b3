"""Fused mHC ops: torch custom ops around the Triton kernels, with autograd and fake impls.

Legend: B batch, T tokens (any leading shape works), S streams, D model dim, C = S*D,
P coefficient logits.

Public functions mirror the eager ones in `birkhoff.model.hyper` (same arguments, same outputs):
`mhc_coefficients`, `contraction_weights`, `mix_in`, `mix_out`. Each is a
`torch.library.custom_op` (`birkhoff::mhc_*`) with `register_autograd` and a fake impl, so
torch.compile traces through them without a graph break, and its backward is a custom op too.
Tensors the backward needs are saved with `ctx.save_for_backward`, so saved-tensor hooks (the
recompute registry) see them.

Design choices:
- The projection raw = x @ phi^T (P = 24 at S = 4) runs inside the coefficient kernel, in the
  same pass over x as the RMS (on the unnormalised streams: the RMS scale is a per-token scalar
  applied to the logits), as an fp32 dot without TF32 so the logits match the eager fp32 ones.
  A cuBLAS GEMM would need an fp32 copy of bf16 streams and a second read of x. Only x in its
  own dtype is saved (shared with what the mixes save), never an fp32 copy per sublayer. In the
  backward one kernel (`rms_grad`) reads x once for g_x = g_raw phi + the RMS term and for
  g_phi = g_raw^T x, the latter as per-program partials over 512 tokens that torch sums in a
  fixed order (deterministic, unlike atomics; 12.6 MB at 16k tokens, C = 3072).
- Coefficients come out in fp32 (Sinkhorn in bf16 is unstable); the mixes accumulate in fp32
  and cast once to the output dtype (mix_in: the dtype of x; mix_out: promote(x, f)).
- Inputs are made contiguous (a no-op for the trainer's streams; the expanded embedding is
  copied once). fp64 inputs are rejected: the kernels compute in fp32; use the eager path.
- On CPU the kernels run only under the Triton interpreter (TRITON_INTERPRET=1, tests).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from birkhoff.kernels import mhc_triton as K

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton does
GPHI_TOKENS = 512  # tokens per partial g_phi block (a multiple of 16)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pad_streams(S: int) -> int:
    return max(2, _pow2(S))


def check_inputs(*tensors: Tensor) -> None:
    """Raise ValueError unless the fused kernels can run on these tensors."""
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"mhc_kernels='triton': dtype={t.dtype} is not fp32/bf16/fp16")
        if not t.is_cuda and not _INTERPRET:
            raise ValueError(f"mhc_kernels='triton': device={t.device} needs CUDA")


# ---- coefficients (+ Sinkhorn) -------------------------------------------------------------


def _coeff_blocks(S: int, C: int, P: int) -> tuple[int, int, int, int]:
    """(SP, PP: S and P padded; BN tokens per program, >= 16 for tl.dot; BC columns per step)."""
    SP, PP = _pad_streams(S), max(16, _pow2(P))
    BN = max(16, min(32, 512 // (SP * SP)))
    return SP, PP, BN, max(16, min(_pow2(C), 4096 // max(BN, PP)))


@torch.library.custom_op("birkhoff::mhc_coefficients", mutates_args=())
def _coefficients_op(
    x_BTSD: Tensor, phi_PC: Tensor, alpha: Tensor, bias_P: Tensor,
    iters: int, with_res: bool, norm_eps: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(H_pre, H_post, H_res, raw logits, rstd); the last two are saved for the backward."""
    pre, post, res, raw_BTP, rstd = _coefficients_fake(x_BTSD, phi_PC, with_res)
    S, D = x_BTSD.shape[-2:]
    N, C, P = rstd.numel(), S * D, phi_PC.shape[0]
    SP, PP, BN, BC = _coeff_blocks(S, C, P)
    if N:
        K.coeff_fwd[(_cdiv(N, BN),)](
            x_BTSD, phi_PC.float().contiguous(), raw_BTP, alpha, bias_P, pre, post, res, rstd,
            N, C, norm_eps, eps, iters,
            S=S, SP=SP, P=P, PP=PP, WITH_RES=with_res, BN=BN, BC=BC,
        )  # fmt: skip
    return pre, post, res, raw_BTP, rstd


def _coefficients_fake(
    x_BTSD: Tensor, phi_PC: Tensor, with_res: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Empty outputs in fp32 (H_post, H_res of shape [0] for the contraction)."""
    lead, S = x_BTSD.shape[:-2], x_BTSD.shape[-2]
    new = x_BTSD.new_empty
    f32 = torch.float32
    post = new((*lead, S) if with_res else (0,), dtype=f32)
    res = new((*lead, S, S) if with_res else (0,), dtype=f32)
    raw = new((*lead, phi_PC.shape[0]), dtype=f32)
    return new((*lead, S), dtype=f32), post, res, raw, new(lead, dtype=f32)


@_coefficients_op.register_fake
def _(x_BTSD, phi_PC, alpha, bias_P, iters, with_res, norm_eps, eps):  # type: ignore[no-untyped-def]
    return _coefficients_fake(x_BTSD, phi_PC, with_res)


@torch.library.custom_op("birkhoff::mhc_coefficients_bwd", mutates_args=())
def _coefficients_bwd_op(
    g_pre: Tensor, g_post: Tensor, g_res: Tensor, x_BTSD: Tensor, phi_PC: Tensor,
    raw_BTP: Tensor, rstd_BT: Tensor, alpha: Tensor, bias_P: Tensor,
    iters: int, with_res: bool, eps: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(g_x, g_phi, g_a: the gradient of the pre-activations alpha z + b)."""
    S, D = x_BTSD.shape[-2:]
    N, C, P = rstd_BT.numel(), S * D, phi_PC.shape[0]
    g_raw, g_a = torch.empty_like(raw_BTP), torch.empty_like(raw_BTP)
    coef_BT = torch.empty_like(rstd_BT)
    SP, PP, BN, _ = _coeff_blocks(S, C, P)
    g_x = torch.empty_like(x_BTSD)
    g_phi = torch.zeros_like(phi_PC)
    if not N:
        return g_x, g_phi, g_a
    K.coeff_bwd[(_cdiv(N, BN),)](
        raw_BTP, rstd_BT, alpha, bias_P, g_pre, g_post, g_res, g_a, g_raw, coef_BT,
        N, C, eps, iters, S=S, SP=SP, P=P, WITH_RES=with_res, BN=BN,
    )  # fmt: skip
    BC = max(16, min(128, 4096 // PP))
    partials = g_raw.new_empty((_cdiv(N, GPHI_TOKENS), PP, C))  # g_phi per block of tokens
    K.rms_grad[(partials.shape[0], _cdiv(C, BC))](
        g_raw, phi_PC.float().contiguous(), x_BTSD, coef_BT, g_x, partials, N, C, GPHI_TOKENS,
        P=P, PP=PP, BN=16, BC=BC, num_warps=8,
    )  # fmt: skip
    g_phi = partials.sum(0)[:P].to(phi_PC.dtype)
    return g_x, g_phi, g_a


@_coefficients_bwd_op.register_fake
def _(g_pre, g_post, g_res, x_BTSD, phi_PC, raw_BTP, rstd_BT, alpha, bias_P, iters, with_res, eps):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_BTSD), torch.empty_like(phi_PC), torch.empty_like(raw_BTP)


def _coefficients_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x_BTSD, phi_PC, alpha, bias_P, iters, with_res, _norm_eps, eps = inputs
    ctx.save_for_backward(x_BTSD, phi_PC, output[3], output[4], alpha, bias_P)
    ctx.mark_non_differentiable(output[3], output[4])
    ctx.hyper = (iters, with_res, eps)


def _coefficients_backward(ctx, g_pre, g_post, g_res, _g_raw, _g_rstd):  # type: ignore[no-untyped-def]
    x_BTSD, phi_PC, raw_BTP, rstd_BT, alpha, bias_P = ctx.saved_tensors
    iters, with_res, eps = ctx.hyper
    zero = _coefficients_fake(x_BTSD, phi_PC, with_res)
    g_pre, g_post, g_res = (
        z.zero_() if g is None else g.contiguous()
        for g, z in zip((g_pre, g_post, g_res), zero[:3], strict=True)
    )
    g_x, g_phi, g_a = _coefficients_bwd_op(
        g_pre, g_post, g_res, x_BTSD, phi_PC, raw_BTP, rstd_BT, alpha, bias_P, iters, with_res,
        eps,
    )  # fmt: skip
    # alpha scales each slice of z = raw * rstd: g_alpha[i] = sum over tokens and slice of g_a z.
    P, S = raw_BTP.shape[-1], x_BTSD.shape[-2]
    gz_P = (g_a * raw_BTP * rstd_BT[..., None]).reshape(-1, P).sum(0)
    sizes = [S, S, S * S] if with_res else [S]
    g_alpha = torch.stack([part.sum() for part in gz_P.split(sizes)])
    return g_x, g_phi, g_alpha, g_a.reshape(-1, P).sum(0), None, None, None, None


_coefficients_op.register_autograd(_coefficients_backward, setup_context=_coefficients_setup)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mhc_coefficients(
    x_BTSD: Tensor, phi_PC: Tensor, alpha_3: Tensor, bias_P: Tensor, *,
    iters: int, norm_eps: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Fused (H_pre [B,T,S], H_post [B,T,S], H_res [B,T,S,S]) in fp32."""
    check_inputs(x_BTSD, phi_PC)
    pre, post, res, _, _ = _coefficients_op(
        x_BTSD.contiguous(), phi_PC.contiguous(), alpha_3.float().contiguous(),
        bias_P.float().contiguous(), iters, True, norm_eps, eps,
    )  # fmt: skip
    return pre, post, res


def contraction_weights(
    x_BTSD: Tensor, phi_SC: Tensor, alpha_1: Tensor, bias_S: Tensor, *, norm_eps: float, eps: float
) -> Tensor:
    """Fused sigmoid weights [B,T,S] of the output contraction (the H_pre path alone)."""
    check_inputs(x_BTSD, phi_SC)
    pre, _, _, _, _ = _coefficients_op(
        x_BTSD.contiguous(), phi_SC.contiguous(), alpha_1.float().contiguous(),
        bias_S.float().contiguous(), 0, False, norm_eps, eps,
    )  # fmt: skip
    return pre


# ---- mix in: y = sum_j h[j] x_j -------------------------------------------------------------
# The ops take and return [B,T,...] tensors (any leading shape; the kernels see N = B*T rows), so
# their outputs are fresh tensors, never views: recompute records them as activations.


def _mix_in_block(S: int, D: int) -> tuple[int, int]:
    SP = _pad_streams(S)
    return SP, max(16, min(_pow2(D), 2048 // SP))


@torch.library.custom_op("birkhoff::mhc_mix_in", mutates_args=())
def _mix_in_op(x_BTSD: Tensor, h_BTS: Tensor) -> Tensor:
    S, D = x_BTSD.shape[-2:]
    y_BTD = x_BTSD.new_empty((*x_BTSD.shape[:-2], D))
    SP, BD = _mix_in_block(S, D)
    if y_BTD.numel():
        K.mix_in_fwd[(h_BTS.numel() // S,)](x_BTSD, h_BTS, y_BTD, D, S=S, SP=SP, BD=BD)
    return y_BTD


@_mix_in_op.register_fake
def _(x_BTSD, h_BTS):  # type: ignore[no-untyped-def]
    return x_BTSD.new_empty((*x_BTSD.shape[:-2], x_BTSD.shape[-1]))


@torch.library.custom_op("birkhoff::mhc_mix_in_bwd", mutates_args=())
def _mix_in_bwd_op(g_BTD: Tensor, x_BTSD: Tensor, h_BTS: Tensor) -> tuple[Tensor, Tensor]:
    S, D = x_BTSD.shape[-2:]
    g_x, g_h = torch.empty_like(x_BTSD), torch.empty_like(h_BTS)
    SP, BD = _mix_in_block(S, D)
    if g_x.numel():
        K.mix_in_bwd[(h_BTS.numel() // S,)](g_BTD, x_BTSD, h_BTS, g_x, g_h, D, S=S, SP=SP, BD=BD)
    return g_x, g_h


@_mix_in_bwd_op.register_fake
def _(g_BTD, x_BTSD, h_BTS):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_BTSD), torch.empty_like(h_BTS)


def _mix_in_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def _mix_in_backward(ctx, g_BTD):  # type: ignore[no-untyped-def]
    return _mix_in_bwd_op(g_BTD.contiguous(), *ctx.saved_tensors)


_mix_in_op.register_autograd(_mix_in_backward, setup_context=_mix_in_setup)


def mix_in(x_BTSD: Tensor, h_BTS: Tensor) -> Tensor:
    """Fused sum_j h[j] x_j -> [B,T,D] in the dtype of x, accumulated in fp32."""
    check_inputs(x_BTSD)
    return _mix_in_op(x_BTSD.contiguous(), h_BTS.float().contiguous())


# ---- mix out: y_k = h_post[k] f + sum_j h_res[j, k] x_j ---------------------------------------


def _mix_out_block(S: int, D: int) -> tuple[int, int]:
    SP = _pad_streams(S)
    return SP, max(16, min(_pow2(D), 4096 // (SP * SP)))


@torch.library.custom_op("birkhoff::mhc_mix_out", mutates_args=())
def _mix_out_op(x_BTSD: Tensor, f_BTD: Tensor, post_BTS: Tensor, res_BTSS: Tensor) -> Tensor:
    S, D = x_BTSD.shape[-2:]
    y_BTSD = torch.empty_like(x_BTSD, dtype=torch.promote_types(x_BTSD.dtype, f_BTD.dtype))
    SP, BD = _mix_out_block(S, D)
    if y_BTSD.numel():
        K.mix_out_fwd[(post_BTS.numel() // S,)](
            x_BTSD, f_BTD, post_BTS, res_BTSS, y_BTSD, D, S=S, SP=SP, BD=BD
        )
    return y_BTSD


@_mix_out_op.register_fake
def _(x_BTSD, f_BTD, post_BTS, res_BTSS):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_BTSD, dtype=torch.promote_types(x_BTSD.dtype, f_BTD.dtype))


@torch.library.custom_op("birkhoff::mhc_mix_out_bwd", mutates_args=())
def _mix_out_bwd_op(
    g_BTSD: Tensor, x_BTSD: Tensor, f_BTD: Tensor, post_BTS: Tensor, res_BTSS: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    S, D = x_BTSD.shape[-2:]
    g_x, g_f = torch.empty_like(x_BTSD), torch.empty_like(f_BTD)
    g_post, g_res = torch.empty_like(post_BTS), torch.empty_like(res_BTSS)
    SP, BD = _mix_out_block(S, D)
    if g_x.numel():
        K.mix_out_bwd[(post_BTS.numel() // S,)](
            g_BTSD, x_BTSD, f_BTD, post_BTS, res_BTSS, g_x, g_f, g_post, g_res, D,
            S=S, SP=SP, BD=BD,
        )  # fmt: skip
    return g_x, g_f, g_post, g_res


@_mix_out_bwd_op.register_fake
def _(g_BTSD, x_BTSD, f_BTD, post_BTS, res_BTSS):  # type: ignore[no-untyped-def]
    return tuple(torch.empty_like(t) for t in (x_BTSD, f_BTD, post_BTS, res_BTSS))


def _mix_out_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def _mix_out_backward(ctx, g_BTSD):  # type: ignore[no-untyped-def]
    return _mix_out_bwd_op(g_BTSD.contiguous(), *ctx.saved_tensors)


_mix_out_op.register_autograd(_mix_out_backward, setup_context=_mix_out_setup)


def mix_out(x_BTSD: Tensor, f_BTD: Tensor, h_post_BTS: Tensor, h_res_BTSS: Tensor) -> Tensor:
    """Fused y_k = H_post[k] F + sum_j H_res[j, k] x_j -> [B,T,S,D], accumulated in fp32."""
    check_inputs(x_BTSD, f_BTD)
    return _mix_out_op(
        x_BTSD.contiguous(), f_BTD.contiguous(),
        h_post_BTS.float().contiguous(), h_res_BTSS.float().contiguous(),
    )  # fmt: skip
