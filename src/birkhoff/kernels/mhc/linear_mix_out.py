"""Mix out as a GEMM epilogue, with autograd: y_k = sum_j H_res[j, k] x_j + H_post[k] (a @ W^T).

Legend: B batch, T tokens (any leading shape; N = B*T rows), S streams, D model dim, Z the
projection's input features (attention heads x head dim, or the MLP hidden size).

Forward: `matmul_mix_out` computes a [BM tokens, BN columns] tile of P = a @ W^T (the output or
down projection) in fp32 accumulators and, in its epilogue, reads the S streams' tiles and writes
the S new streams (`mixes.mix_out_stream`), so F = P never goes to HBM to be read back by a mix
kernel; P is not rounded to the operands' dtype first (the unfused path rounds it once). When a
gradient is needed the epilogue also stores P in the operands' dtype: H_post's gradient
<g_y_k, P> needs it, and D values a token cost less than recomputing the GEMM. Backward: the mix
out's backward kernel (`mixes.mix_out_grads`: g_x, g_P = sum_k H_post[k] g_y_k, g_post, g_res),
then g_a = g_P W and g_W = g_P^T a with torch's GEMMs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import check_inputs, tl, triton
from birkhoff.kernels.fused_op import FusedOp, traceable
from birkhoff.kernels.mhc.fold_gemm import dot_acc, gemm_launch, gemm_tile, load_wt
from birkhoff.kernels.mhc.mixes import mix_out_grads, mix_out_stream


@triton.jit
def _project(a_ptr, w_ptr, m64, m_ok, cols, col_ok, Z, BM, BN, BK, IEEE, EMU):
    """The [BM, BN] tile of a @ W^T in fp32 (a [N, Z], W [D, Z], both row-major)."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, Z, BK):
        k = k0 + tl.arange(0, BK)
        a_ok = m_ok[:, None] & (k < Z)[None, :]
        a = tl.load(a_ptr + m64[:, None] * Z + k[None, :], mask=a_ok, other=0.0)
        acc = dot_acc(a, load_wt(w_ptr, cols, col_ok, k, Z), acc, IEEE, EMU)
    return acc


@triton.jit
def matmul_mix_out(
    a_ptr,
    w_ptr,
    x_ptr,
    post_ptr,
    res_ptr,
    y_ptr,
    p_ptr,
    N,
    D,
    Z,
    S: tl.constexpr,
    SAVE_P: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
    EMU: tl.constexpr,
):
    """y[n, k, d] = sum_j res[n, j, k] x[n, j, d] + post[n, k] P[n, d]; P[n, d] into p_ptr if
    SAVE_P."""
    m, cols = gemm_tile(N, D, BM, BN, GROUP_M)
    m_ok, col_ok, m64 = m < N, cols < D, m.to(tl.int64)
    p = _project(a_ptr, w_ptr, m64, m_ok, cols, col_ok, Z, BM, BN, BK, IEEE, EMU)
    ok = m_ok[:, None] & col_ok[None, :]
    if SAVE_P:
        tl.store(p_ptr + m64[:, None] * D + cols[None, :], p.to(p_ptr.dtype.element_ty), mask=ok)
    row = m64[:, None] * (S * D) + cols[None, :]
    for k in tl.static_range(S):
        mix_out_stream(x_ptr, p, post_ptr, res_ptr, y_ptr, m64, m_ok, row, ok, k, S, D, BM, BN)


def _forward_impl(
    a_BTZ: Tensor, w_DZ: Tensor, x_BTSD: Tensor, post_BTS: Tensor, res_BTSS: Tensor, save_p: bool
) -> tuple[Tensor, Tensor]:
    """(y [B,T,S,D] in promote(x, W), P [B,T,D] in W's dtype if save_p else shape [0])."""
    S, D = x_BTSD.shape[-2:]
    N, Z = post_BTS.numel() // S, w_DZ.shape[1]
    y = torch.empty_like(x_BTSD, dtype=torch.promote_types(x_BTSD.dtype, w_DZ.dtype))
    p = a_BTZ.new_empty((*a_BTZ.shape[:-1], D) if save_p else (0,))
    if N:
        grid, cfg = gemm_launch(N, D, Z, w_DZ.dtype)
        args = (a_BTZ, w_DZ, x_BTSD, post_BTS, res_BTSS, y, p if save_p else y, N, D, Z)
        traceable(matmul_mix_out)[grid](*args, S=S, SAVE_P=save_p, **cfg)
    return y, p


def _forward_fake(a_BTZ, w_DZ, x_BTSD, post_BTS, res_BTSS, save_p):  # type: ignore[no-untyped-def]
    y = torch.empty_like(x_BTSD, dtype=torch.promote_types(x_BTSD.dtype, w_DZ.dtype))
    D = x_BTSD.shape[-1]
    return y, a_BTZ.new_empty((*a_BTZ.shape[:-1], D) if save_p else (0,))


_op = FusedOp("mhc_linear_mix_out", _forward_impl, _forward_fake)


def _backward_impl(
    g_BTSD: Tensor,
    a_BTZ: Tensor,
    w_DZ: Tensor,
    x_BTSD: Tensor,
    post: Tensor,
    res: Tensor,
    p: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(g_a, g_W, g_x, g_post, g_res): the mix out's backward with F = P, then the GEMMs."""
    g_x, g_p, g_post, g_res = mix_out_grads(g_BTSD, x_BTSD, p, post, res)
    Z = w_DZ.shape[1]
    g_a = (g_p @ w_DZ).reshape(a_BTZ.shape)
    g_w = g_p.reshape(-1, w_DZ.shape[0]).t() @ a_BTZ.reshape(-1, Z)
    return g_a, g_w, g_x, g_post, g_res


def _backward_fake(g_BTSD, a_BTZ, w_DZ, x_BTSD, post, res, p):  # type: ignore[no-untyped-def]
    return tuple(torch.empty_like(t) for t in (a_BTZ, w_DZ, x_BTSD, post, res))


_bwd_op = FusedOp("mhc_linear_mix_out_bwd", _backward_impl, _backward_fake)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a_BTZ, w_DZ, x_BTSD, post, res, _save_p = inputs
    ctx.save_for_backward(a_BTZ, w_DZ, x_BTSD, post, res, output[1])
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, g_BTSD, _g_p):  # type: ignore[no-untyped-def]
    return *_bwd_op(g_BTSD.contiguous(), *ctx.saved_tensors), None


_op.register_autograd(_backward, setup_context=_setup)


def linear_mix_out(
    a_BTZ: Tensor, w_DZ: Tensor, x_BTSD: Tensor, h_post_BTS: Tensor, h_res_BTSS: Tensor
) -> Tensor:
    """Fused y_k = sum_j H_res[j, k] x_j + H_post[k] (a @ W^T) -> [B,T,S,D] in promote(x, W);
    a is cast to W's dtype (pass W in the autocast dtype to multiply in it)."""
    check_inputs(x_BTSD, a_BTZ, w_DZ)
    S, D = x_BTSD.shape[-2:]
    if w_DZ.dim() != 2 or w_DZ.shape != (D, a_BTZ.shape[-1]):
        raise ValueError(f"W {tuple(w_DZ.shape)} does not fit a {tuple(a_BTZ.shape)}, D={D}")
    if a_BTZ.shape[:-1] != x_BTSD.shape[:-2]:
        raise ValueError(f"a {tuple(a_BTZ.shape)} does not fit x {tuple(x_BTSD.shape)}")
    a = a_BTZ.to(w_DZ.dtype).contiguous()
    post, res = h_post_BTS.float().contiguous(), h_res_BTSS.float().contiguous()
    x, w = x_BTSD.contiguous(), w_DZ.contiguous()
    save_p = torch.is_grad_enabled() and any(t.requires_grad for t in (a, w, x, post, res))
    return _op(a, w, x, post, res, save_p)[0]  # type: ignore[no-any-return]
