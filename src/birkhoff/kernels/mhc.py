"""Fused mHC ops: torch custom ops around the Triton kernels, with autograd and fake impls.

Legend: B batch, T tokens, N = B*T, S streams, D model dim, C = S*D, P coefficient logits.

Public functions mirror the eager ones in `birkhoff.model.hyper` (same arguments, same outputs):
`mhc_coefficients`, `contraction_weights`, `mix_in`, `mix_out`. Each is a
`torch.library.custom_op` (`birkhoff::mhc_*`) with `register_autograd` and a fake impl, so
torch.compile traces through them without a graph break, and its backward is a custom op too.
Tensors the backward needs are saved with `ctx.save_for_backward`, so saved-tensor hooks (the
recompute registry) see them.

Design choices:
- The projection raw = x @ phi^T (N x C times C x P, P = 24 at S = 4) stays a cuBLAS fp32
  matmul outside the kernel, computed from the unnormalised streams (the RMS scale is a per-token
  scalar applied to the logits in the kernel). An fp32 GEMM keeps the eager numerics (no TF32);
  a Triton dot in fp32 over P = 24 (padded to 32) would run on CUDA cores at ~14 flops per byte,
  no faster than cuBLAS. Its backward (g_phi = g_raw^T x, g_x += g_raw phi) is autograd's.
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


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pad_streams(S: int) -> int:
    return max(2, _pow2(S))


def check_inputs(*tensors: Tensor) -> None:
    """Raise ValueError unless the fused kernels can run on these tensors."""
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"mhc_kernels='triton': dtype={t.dtype} is not fp32/bf16/fp16")
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"mhc_kernels='triton': device={t.device} needs CUDA")


# ---- coefficients (+ Sinkhorn) -------------------------------------------------------------


def _coeff_blocks(S: int, C: int) -> tuple[int, int, int]:
    SP = _pad_streams(S)
    BN = max(1, min(32, 512 // (SP * SP)))
    return SP, BN, max(16, min(_pow2(C), 4096 // BN))


@torch.library.custom_op("birkhoff::mhc_coefficients", mutates_args=())
def _coefficients_op(
    x_NC: Tensor, raw_NP: Tensor, alpha: Tensor, bias_P: Tensor,
    S: int, iters: int, with_res: bool, norm_eps: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    N, C = x_NC.shape
    f32 = dict(dtype=torch.float32, device=x_NC.device)
    pre_NS, rstd_N = torch.empty((N, S), **f32), torch.empty((N,), **f32)
    post_NS = torch.empty((N, S) if with_res else (0,), **f32)
    res_NSS = torch.empty((N, S, S) if with_res else (0,), **f32)
    SP, BN, BC = _coeff_blocks(S, C)
    if N:
        K.coeff_fwd[(_cdiv(N, BN),)](
            x_NC, raw_NP, alpha, bias_P, pre_NS, post_NS, res_NSS, rstd_N,
            N, C, norm_eps, eps, iters,
            S=S, SP=SP, P=raw_NP.shape[1], WITH_RES=with_res, BN=BN, BC=BC,
        )  # fmt: skip
    return pre_NS, post_NS, res_NSS, rstd_N


@_coefficients_op.register_fake
def _(x_NC, raw_NP, alpha, bias_P, S, iters, with_res, norm_eps, eps):  # type: ignore[no-untyped-def]
    N = x_NC.shape[0]
    new = x_NC.new_empty
    post_shape, res_shape = ((N, S), (N, S, S)) if with_res else ((0,), (0,))
    f32 = torch.float32
    return new((N, S), dtype=f32), new(post_shape, dtype=f32), new(res_shape, dtype=f32), new(
        (N,), dtype=f32
    )


@torch.library.custom_op("birkhoff::mhc_coefficients_bwd", mutates_args=())
def _coefficients_bwd_op(
    g_pre: Tensor, g_post: Tensor, g_res: Tensor, x_NC: Tensor, raw_NP: Tensor, rstd_N: Tensor,
    alpha: Tensor, bias_P: Tensor, S: int, iters: int, with_res: bool, eps: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(g_x [N,C] through the RMS scale, g_raw [N,P], g_a [N,P] of the pre-activations)."""
    N, C = x_NC.shape
    g_x = torch.empty_like(x_NC)
    g_raw, g_a = torch.empty_like(raw_NP), torch.empty_like(raw_NP)
    SP, BN, BC = _coeff_blocks(S, C)
    if N:
        K.coeff_bwd[(_cdiv(N, BN),)](
            x_NC, raw_NP, rstd_N, alpha, bias_P, g_pre, g_post, g_res, g_a, g_raw, g_x,
            N, C, eps, iters,
            S=S, SP=SP, P=raw_NP.shape[1], WITH_RES=with_res, BN=BN, BC=BC,
        )  # fmt: skip
    return g_x, g_raw, g_a


@_coefficients_bwd_op.register_fake
def _(g_pre, g_post, g_res, x_NC, raw_NP, rstd_N, alpha, bias_P, S, iters, with_res, eps):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_NC), torch.empty_like(raw_NP), torch.empty_like(raw_NP)


def _coefficients_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x_NC, raw_NP, alpha, bias_P, S, iters, with_res, _norm_eps, eps = inputs
    ctx.save_for_backward(x_NC, raw_NP, output[3], alpha, bias_P)
    ctx.hyper = (S, iters, with_res, eps)


def _coefficients_backward(ctx, g_pre, g_post, g_res, _g_rstd):  # type: ignore[no-untyped-def]
    x_NC, raw_NP, rstd_N, alpha, bias_P = ctx.saved_tensors
    S, iters, with_res, eps = ctx.hyper
    N = x_NC.shape[0]
    zeros = raw_NP.new_zeros
    g_pre = zeros((N, S)) if g_pre is None else g_pre.contiguous()
    g_post = zeros((N, S) if with_res else (0,)) if g_post is None else g_post.contiguous()
    g_res = zeros((N, S, S) if with_res else (0,)) if g_res is None else g_res.contiguous()
    g_x, g_raw, g_a = _coefficients_bwd_op(
        g_pre, g_post, g_res, x_NC, raw_NP, rstd_N, alpha, bias_P, S, iters, with_res, eps
    )
    # alpha scales each slice of z = raw * rstd: g_alpha[i] = sum over tokens and slice of g_a z.
    gz_P = (g_a * raw_NP * rstd_N[:, None]).sum(0)
    sizes = [S, S, S * S] if with_res else [S]
    g_alpha = torch.stack([part.sum() for part in gz_P.split(sizes)])
    return g_x, g_raw, g_alpha, g_a.sum(0), None, None, None, None, None


_coefficients_op.register_autograd(_coefficients_backward, setup_context=_coefficients_setup)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _logits(x_BTSD: Tensor, phi_PC: Tensor) -> tuple[Tensor, Tensor]:
    """(x [N,C] contiguous, raw = x @ phi^T [N,P] in fp32): the cuBLAS part of the projection."""
    B, T, S, D = x_BTSD.shape
    x_NC = x_BTSD.reshape(B * T, S * D).contiguous()
    with torch.autocast(device_type=x_NC.device.type, enabled=False):
        raw_NP = x_NC.float() @ phi_PC.float().t()
    return x_NC, raw_NP.contiguous()


def mhc_coefficients(
    x_BTSD: Tensor, phi_PC: Tensor, alpha_3: Tensor, bias_P: Tensor, *,
    iters: int, norm_eps: float, eps: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Fused (H_pre [B,T,S], H_post [B,T,S], H_res [B,T,S,S]) in fp32."""
    check_inputs(x_BTSD, phi_PC)
    B, T, S, _ = x_BTSD.shape
    x_NC, raw_NP = _logits(x_BTSD, phi_PC)
    pre, post, res, _ = _coefficients_op(
        x_NC, raw_NP, alpha_3.float().contiguous(), bias_P.float().contiguous(),
        S, iters, True, norm_eps, eps,
    )  # fmt: skip
    return pre.view(B, T, S), post.view(B, T, S), res.view(B, T, S, S)


def contraction_weights(
    x_BTSD: Tensor, phi_SC: Tensor, alpha_1: Tensor, bias_S: Tensor, *, norm_eps: float, eps: float
) -> Tensor:
    """Fused sigmoid weights [B,T,S] of the output contraction (the H_pre path alone)."""
    check_inputs(x_BTSD, phi_SC)
    B, T, S, _ = x_BTSD.shape
    x_NC, raw_NS = _logits(x_BTSD, phi_SC)
    pre, _, _, _ = _coefficients_op(
        x_NC, raw_NS, alpha_1.float().contiguous(), bias_S.float().contiguous(),
        S, 0, False, norm_eps, eps,
    )  # fmt: skip
    return pre.view(B, T, S)


# ---- mix in: y = sum_j h[j] x_j -------------------------------------------------------------


def _mix_in_block(S: int, D: int) -> tuple[int, int]:
    SP = _pad_streams(S)
    return SP, max(16, min(_pow2(D), 2048 // SP))


@torch.library.custom_op("birkhoff::mhc_mix_in", mutates_args=())
def _mix_in_op(x_NSD: Tensor, h_NS: Tensor) -> Tensor:
    N, S, D = x_NSD.shape
    y_ND = x_NSD.new_empty((N, D))
    SP, BD = _mix_in_block(S, D)
    if N:
        K.mix_in_fwd[(N,)](x_NSD, h_NS, y_ND, D, S=S, SP=SP, BD=BD)
    return y_ND


@_mix_in_op.register_fake
def _(x_NSD, h_NS):  # type: ignore[no-untyped-def]
    return x_NSD.new_empty((x_NSD.shape[0], x_NSD.shape[2]))


@torch.library.custom_op("birkhoff::mhc_mix_in_bwd", mutates_args=())
def _mix_in_bwd_op(g_ND: Tensor, x_NSD: Tensor, h_NS: Tensor) -> tuple[Tensor, Tensor]:
    N, S, D = x_NSD.shape
    g_x, g_h = torch.empty_like(x_NSD), torch.empty_like(h_NS)
    SP, BD = _mix_in_block(S, D)
    if N:
        K.mix_in_bwd[(N,)](g_ND, x_NSD, h_NS, g_x, g_h, D, S=S, SP=SP, BD=BD)
    return g_x, g_h


@_mix_in_bwd_op.register_fake
def _(g_ND, x_NSD, h_NS):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_NSD), torch.empty_like(h_NS)


def _mix_in_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def _mix_in_backward(ctx, g_ND):  # type: ignore[no-untyped-def]
    x_NSD, h_NS = ctx.saved_tensors
    return _mix_in_bwd_op(g_ND.contiguous(), x_NSD, h_NS)


_mix_in_op.register_autograd(_mix_in_backward, setup_context=_mix_in_setup)


def mix_in(x_BTSD: Tensor, h_BTS: Tensor) -> Tensor:
    """Fused sum_j h[j] x_j -> [B,T,D] in the dtype of x, accumulated in fp32."""
    check_inputs(x_BTSD)
    B, T, S, D = x_BTSD.shape
    x_NSD = x_BTSD.reshape(B * T, S, D).contiguous()
    y_ND = _mix_in_op(x_NSD, h_BTS.reshape(B * T, S).float().contiguous())
    return y_ND.view(B, T, D)


# ---- mix out: y_k = h_post[k] f + sum_j h_res[j, k] x_j ---------------------------------------


def _mix_out_block(S: int, D: int) -> tuple[int, int]:
    SP = _pad_streams(S)
    return SP, max(16, min(_pow2(D), 4096 // (SP * SP)))


@torch.library.custom_op("birkhoff::mhc_mix_out", mutates_args=())
def _mix_out_op(x_NSD: Tensor, f_ND: Tensor, post_NS: Tensor, res_NSS: Tensor) -> Tensor:
    N, S, D = x_NSD.shape
    y_NSD = torch.empty_like(x_NSD, dtype=torch.promote_types(x_NSD.dtype, f_ND.dtype))
    SP, BD = _mix_out_block(S, D)
    if N:
        K.mix_out_fwd[(N,)](x_NSD, f_ND, post_NS, res_NSS, y_NSD, D, S=S, SP=SP, BD=BD)
    return y_NSD


@_mix_out_op.register_fake
def _(x_NSD, f_ND, post_NS, res_NSS):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_NSD, dtype=torch.promote_types(x_NSD.dtype, f_ND.dtype))


@torch.library.custom_op("birkhoff::mhc_mix_out_bwd", mutates_args=())
def _mix_out_bwd_op(
    g_NSD: Tensor, x_NSD: Tensor, f_ND: Tensor, post_NS: Tensor, res_NSS: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    N, S, D = x_NSD.shape
    g_x, g_f = torch.empty_like(x_NSD), torch.empty_like(f_ND)
    g_post, g_res = torch.empty_like(post_NS), torch.empty_like(res_NSS)
    SP, BD = _mix_out_block(S, D)
    if N:
        K.mix_out_bwd[(N,)](
            g_NSD, x_NSD, f_ND, post_NS, res_NSS, g_x, g_f, g_post, g_res, D, S=S, SP=SP, BD=BD
        )
    return g_x, g_f, g_post, g_res


@_mix_out_bwd_op.register_fake
def _(g_NSD, x_NSD, f_ND, post_NS, res_NSS):  # type: ignore[no-untyped-def]
    return tuple(torch.empty_like(t) for t in (x_NSD, f_ND, post_NS, res_NSS))


def _mix_out_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def _mix_out_backward(ctx, g_NSD):  # type: ignore[no-untyped-def]
    return _mix_out_bwd_op(g_NSD.contiguous(), *ctx.saved_tensors)


_mix_out_op.register_autograd(_mix_out_backward, setup_context=_mix_out_setup)


def mix_out(x_BTSD: Tensor, f_BTD: Tensor, h_post_BTS: Tensor, h_res_BTSS: Tensor) -> Tensor:
    """Fused y_k = H_post[k] F + sum_j H_res[j, k] x_j -> [B,T,S,D], accumulated in fp32."""
    check_inputs(x_BTSD, f_BTD)
    B, T, S, D = x_BTSD.shape
    y_NSD = _mix_out_op(
        x_BTSD.reshape(B * T, S, D).contiguous(),
        f_BTD.reshape(B * T, D).contiguous(),
        h_post_BTS.reshape(B * T, S).float().contiguous(),
        h_res_BTSS.reshape(B * T, S, S).float().contiguous(),
    )
    return y_NSD.view(B, T, S, D)
