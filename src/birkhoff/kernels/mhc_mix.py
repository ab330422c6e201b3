"""Fused stream mixes: torch custom ops around the mix kernels, and the input checks shared
by every fused mHC op.

Legend: B batch, T tokens (any leading shape works), S streams, D model dim.

`mix_in` (y = sum_j h[j] x_j) and `mix_out` (y_k = H_post[k] F + sum_j H_res[j, k] x_j) are
`torch.library.custom_op`s (`birkhoff::mhc_mix_*`) with `register_autograd` and fake impls; the
backward is a custom op too (eager code calls them through `ops.FusedOp`'s direct entry). The
kernels tile [BN tokens, BD columns] over a 2-D grid (`CONFIG["mix"]`); their reductions over D
(g_h, g_post, g_res) come as one partial per D block, summed by torch in a fixed order.
`mix_in_into` and `mix_in_weight_grad` are the kernel launches the coefficient op reuses when
it mixes in itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import mhc_mix_triton as M
from birkhoff.kernels.mhc_configs import CONFIG
from birkhoff.kernels.ops import INTERPRET, FusedOp, traceable

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pad_streams(S: int) -> int:
    return max(2, pow2(S))


def check_device(*tensors: Tensor) -> None:
    """Raise ValueError unless these tensors live where the fused kernels run (CUDA, or any
    device under the Triton interpreter)."""
    for t in tensors:
        if not t.is_cuda and not INTERPRET:
            raise ValueError(f"mhc_kernels='triton': device={t.device} needs CUDA")


def check_inputs(*tensors: Tensor) -> None:
    """Raise ValueError unless the fused kernels can run on these tensors."""
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"mhc_kernels='triton': dtype={t.dtype} is not fp32/bf16/fp16")
        check_device(t)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- mix in: y = sum_j h[j] x_j -------------------------------------------------------------
# The ops take and return [B,T,...] tensors (any leading shape; the kernels see N = B*T rows), so
# their outputs are fresh tensors, never views: recompute records them as activations.


def _mix_grid(N: int, S: int, D: int) -> tuple[tuple[int, int], dict[str, int]]:
    """(grid: token blocks x D blocks, launch parameters) of the mix kernels (tuned at S = 4)."""
    cfg = {k: int(v) for k, v in CONFIG["mix"].items()}
    cfg["BD"] = min(cfg["BD"], max(16, pow2(D)))
    cfg["BN"] = max(1, cfg["BN"] * 4 // max(4, pow2(S)))  # S tiles live at once
    return (cdiv(N, cfg["BN"]), cdiv(D, cfg["BD"])), cfg


def _sum_parts(parts: Tensor) -> Tensor:
    """Sum of the per-D-block partials [ND, ...] in a fixed order (no copy when ND = 1)."""
    return parts[0] if parts.shape[0] == 1 else parts.sum(0)


def mix_in_into(y_BTD: Tensor, x_BTSD: Tensor, h_BTS: Tensor) -> None:
    """Write sum_j h[j] x_j into y_BTD (contiguous tensors, h in fp32)."""
    S, D = x_BTSD.shape[-2:]
    N = h_BTS.numel() // S
    grid, cfg = _mix_grid(N, S, D)
    if y_BTD.numel():
        traceable(M.mix_in_fwd)[grid](x_BTSD, h_BTS, y_BTD, N, D, S=S, **cfg)


def _mix_in_bwd(g_BTD: Tensor, x_BTSD: Tensor, h_BTS: Tensor, g_x: Tensor | None) -> Tensor:
    """g_h [B,T,S] (fp32); also g_x = h g_y into g_x unless it is None."""
    S, D = x_BTSD.shape[-2:]
    N = h_BTS.numel() // S
    grid, cfg = _mix_grid(N, S, D)
    if not x_BTSD.numel():
        return torch.zeros_like(h_BTS)
    parts = h_BTS.new_empty((grid[1], *h_BTS.shape))
    traceable(M.mix_in_bwd)[grid](
        g_BTD, x_BTSD, h_BTS, x_BTSD if g_x is None else g_x, parts, N, D,
        S=S, WRITE_GX=g_x is not None, **cfg,
    )  # fmt: skip
    return _sum_parts(parts)


def mix_in_weight_grad(g_BTD: Tensor, x_BTSD: Tensor, h_BTS: Tensor) -> Tensor:
    """g_h[j] = <g_y, x_j> [B,T,S] in fp32 for y = sum_j h[j] x_j (contiguous tensors)."""
    return _mix_in_bwd(g_BTD, x_BTSD, h_BTS, None)


def _mix_in_impl(x_BTSD: Tensor, h_BTS: Tensor) -> Tensor:
    y_BTD = x_BTSD.new_empty((*x_BTSD.shape[:-2], x_BTSD.shape[-1]))
    mix_in_into(y_BTD, x_BTSD, h_BTS)
    return y_BTD


def _mix_in_fake(x_BTSD, h_BTS):  # type: ignore[no-untyped-def]
    return x_BTSD.new_empty((*x_BTSD.shape[:-2], x_BTSD.shape[-1]))


_mix_in_op = FusedOp("mhc_mix_in", _mix_in_impl, _mix_in_fake)


def _mix_in_bwd_impl(g_BTD: Tensor, x_BTSD: Tensor, h_BTS: Tensor) -> tuple[Tensor, Tensor]:
    g_x = torch.empty_like(x_BTSD)
    return g_x, _mix_in_bwd(g_BTD, x_BTSD, h_BTS, g_x)


def _mix_in_bwd_fake(g_BTD, x_BTSD, h_BTS):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_BTSD), torch.empty_like(h_BTS)


_mix_in_bwd_op = FusedOp("mhc_mix_in_bwd", _mix_in_bwd_impl, _mix_in_bwd_fake)


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


def _mix_out_impl(x_BTSD: Tensor, f_BTD: Tensor, post_BTS: Tensor, res_BTSS: Tensor) -> Tensor:
    S, D = x_BTSD.shape[-2:]
    y_BTSD = torch.empty_like(x_BTSD, dtype=torch.promote_types(x_BTSD.dtype, f_BTD.dtype))
    N = post_BTS.numel() // S
    grid, cfg = _mix_grid(N, S, D)
    if y_BTSD.numel():
        traceable(M.mix_out_fwd)[grid](x_BTSD, f_BTD, post_BTS, res_BTSS, y_BTSD, N, D, S=S, **cfg)
    return y_BTSD


def _mix_out_fake(x_BTSD, f_BTD, post_BTS, res_BTSS):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_BTSD, dtype=torch.promote_types(x_BTSD.dtype, f_BTD.dtype))


_mix_out_op = FusedOp("mhc_mix_out", _mix_out_impl, _mix_out_fake)


def _mix_out_bwd_impl(
    g_BTSD: Tensor, x_BTSD: Tensor, f_BTD: Tensor, post_BTS: Tensor, res_BTSS: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    S, D = x_BTSD.shape[-2:]
    g_x, g_f = torch.empty_like(x_BTSD), torch.empty_like(f_BTD)
    N = post_BTS.numel() // S
    grid, cfg = _mix_grid(N, S, D)
    if not g_x.numel():
        return g_x, g_f.zero_(), torch.zeros_like(post_BTS), torch.zeros_like(res_BTSS)
    parts_post = post_BTS.new_empty((grid[1], *post_BTS.shape))
    parts_res = res_BTSS.new_empty((grid[1], *res_BTSS.shape))
    traceable(M.mix_out_bwd)[grid](
        g_BTSD, x_BTSD, f_BTD, post_BTS, res_BTSS, g_x, g_f, parts_post, parts_res, N, D,
        S=S, **cfg,
    )  # fmt: skip
    g_post, g_res = _sum_parts(parts_post), _sum_parts(parts_res)
    return g_x, g_f, g_post, g_res


def _mix_out_bwd_fake(g_BTSD, x_BTSD, f_BTD, post_BTS, res_BTSS):  # type: ignore[no-untyped-def]
    return tuple(torch.empty_like(t) for t in (x_BTSD, f_BTD, post_BTS, res_BTSS))


_mix_out_bwd_op = FusedOp("mhc_mix_out_bwd", _mix_out_bwd_impl, _mix_out_bwd_fake)


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
