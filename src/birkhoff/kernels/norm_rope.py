"""The engine's per-token ops as fused forward-only custom ops, for inference (the engine's
decode, verify, draft and prefill chunks): RMSNorm (`birkhoff::rms_norm`), rotary embedding
(`birkhoff::rope`), an attention layer's rope + KV-cache write (`birkhoff::rope_cache`) and
SwiGLU's silu(gate) * up (`birkhoff::silu_mul`).

Legend: N rows, D normalised dim, A rows of a chunk, T tokens, H heads, G kv heads, K head dim,
B cache rows, N cache positions, F MLP hidden.

`model.layers.rms_norm`, `apply_rope` and `swiglu` dispatch here when asked for fused kernels
on CUDA and no gradient is needed (the training path keeps the eager functions and their
autograd); engine/forward.py calls `rope_cache` where the eager path calls `apply_rope` twice
and `KVCache.write`. Inputs
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


@torch.library.custom_op("birkhoff::rope_cache", mutates_args=("k_cache_BGNK", "v_cache_BGNK"))
def rope_cache(
    q_ATHK: Tensor, k_ATGK: Tensor, v_ATGK: Tensor, cos_ATK2: Tensor, sin_ATK2: Tensor,
    k_cache_BGNK: Tensor, v_cache_BGNK: Tensor, rows_A: Tensor, positions_AT: Tensor,
) -> Tensor:  # fmt: skip
    """An attention layer's prologue: returns rope(q) and writes rope(k) and v into the caches
    at (rows_A[a], positions_AT[a, t]), as `rope` and `KVCache.write` do one by one (padded
    tokens point at the trash slot, which several may write)."""
    check_inputs(q_ATHK, k_ATGK, v_ATGK, k_cache_BGNK, v_cache_BGNK)
    A, T, H, K = q_ATHK.shape
    G = k_ATGK.shape[2]
    views = (q_ATHK, k_ATGK, v_ATGK, k_cache_BGNK, v_cache_BGNK)
    if any(t.stride(-1) != 1 for t in views) or K % 2:
        raise ValueError("rope_cache: head dims must be contiguous and even")
    cos, sin = cos_ATK2.contiguous(), sin_ATK2.contiguous()
    q_out = torch.empty((A, T, H, K), dtype=q_ATHK.dtype, device=q_ATHK.device)
    if A * T:
        R.rope_cache_fwd[(A * T,)](
            q_ATHK, k_ATGK, v_ATGK, cos, sin, q_out, k_cache_BGNK, v_cache_BGNK, rows_A,
            positions_AT, T, H, G, K // 2,
            *q_ATHK.stride()[:3], *k_ATGK.stride()[:3], *v_ATGK.stride()[:3],
            *positions_AT.stride(), *k_cache_BGNK.stride()[:3], *v_cache_BGNK.stride()[:3],
            BH=max(2, pow2(max(H, G))), BK=max(16, pow2(K // 2)),
            num_warps=1 if max(H, G) * K <= 1024 else 4,
        )  # fmt: skip
    return q_out


@rope_cache.register_fake
def _(q_ATHK, k_ATGK, v_ATGK, cos_ATK2, sin_ATK2, k_cache_BGNK, v_cache_BGNK, rows_A, positions_AT):  # type: ignore[no-untyped-def]  # noqa: E501
    return torch.empty_like(q_ATHK, memory_format=torch.contiguous_format)


@torch.library.custom_op("birkhoff::silu_mul", mutates_args=())
def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU silu(gate) * up of `gate_up` = [gate | up] along the last dim, in fp32, cast back."""
    check_inputs(gate_up)
    F2 = gate_up.shape[-1]
    if F2 % 2:
        raise ValueError(f"silu_mul: last dim {F2} is not [gate | up]")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    x_NF = gate_up.reshape(-1, F2)
    N, F = x_NF.shape[0], F2 // 2
    y = torch.empty((*gate_up.shape[:-1], F), dtype=gate_up.dtype, device=gate_up.device)
    BF = min(1024, max(16, pow2(F)))
    BN = max(1, min(16, 2048 // BF))
    if N:
        R.silu_mul_fwd[(-(-N // BN), -(-F // BF))](x_NF, y, N, F, x_NF.stride(0), BN=BN, BF=BF)
    return y


@silu_mul.register_fake
def _(gate_up):  # type: ignore[no-untyped-def]
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
