"""RMSNorm and rotary embedding as fused forward-only custom ops (`birkhoff::rms_norm`,
`birkhoff::rope`), for inference: the engine's decode, verify and draft steps.

Legend: N rows, D normalised dim, T tokens, H heads, K head dim.

`model.layers.rms_norm` and `apply_rope` dispatch here when asked for fused kernels on CUDA and
no gradient is needed (the training path keeps the eager functions and their autograd). Inputs
may be strided views whose last dim is contiguous (q and k come as views of the fused qkv
projection); outputs are fresh contiguous tensors in the input's dtype. Registered as custom ops
with fake implementations, so a compiled region calling them does not break its graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import norm_rope_triton as R
from birkhoff.kernels.mhc_mix import check_inputs, pow2


@torch.library.custom_op("birkhoff::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x / rms(x) * weight over the last dim, in fp32, cast back to x's dtype."""
    check_inputs(x, *(() if weight is None else (weight,)))
    D = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    x_ND = x.reshape(-1, D)  # a view unless the leading dims do not merge
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    N, BD = x_ND.shape[0], max(16, pow2(D))
    BN = max(1, min(16, 4096 // BD))
    if N:
        R.rms_norm_fwd[(-(-N // BN),)](
            x_ND, x_ND if weight is None else weight, y, N, D, x_ND.stride(0), eps,
            HAS_W=weight is not None, BN=BN, BD=BD, num_warps=4 if BD <= 4096 else 8,
        )  # fmt: skip
    return y


@rms_norm.register_fake
def _(x, weight, eps):  # type: ignore[no-untyped-def]
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("birkhoff::rope", mutates_args=())
def rope(x_BTHK: Tensor, cos_BTK2: Tensor, sin_BTK2: Tensor) -> Tensor:
    """x rotated by the per-token angles in the 'half' layout, in fp32, cast back."""
    check_inputs(x_BTHK)
    B, T, H, K = x_BTHK.shape
    if x_BTHK.stride(-1) != 1 or x_BTHK.stride(0) != T * x_BTHK.stride(1):
        x_BTHK = x_BTHK.contiguous()
    cos, sin = cos_BTK2.contiguous(), sin_BTK2.contiguous()
    y = torch.empty((B, T, H, K), dtype=x_BTHK.dtype, device=x_BTHK.device)
    BK = max(16, pow2(K // 2))
    BH = max(1, min(pow2(H), 2048 // BK))
    if B * T:
        R.rope_fwd[(B * T, -(-H // BH))](
            x_BTHK, cos, sin, y, H, K // 2, x_BTHK.stride(1), x_BTHK.stride(2), BH=BH, BK=BK
        )
    return y


@rope.register_fake
def _(x_BTHK, cos_BTK2, sin_BTK2):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_BTHK, memory_format=torch.contiguous_format)
