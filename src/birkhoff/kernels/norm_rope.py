"""The engine's per-token ops as fused forward-only custom ops: RMSNorm (`birkhoff::rms_norm`),
rotary embedding (`birkhoff::rope`), an attention layer's rope + KV-cache write
(`birkhoff::rope_cache`) and SwiGLU's silu(gate) * up (`birkhoff::silu_mul`).

Legend: N rows, D normalised dim, A rows of a chunk, T tokens, H heads, G kv heads, K head dim,
B cache rows, F MLP hidden.

Each replaces a chain of eager elementwise kernels with one launch that reads its input once and
writes its output once, in fp32 as the eager functions compute. `model.layers` dispatches here
when fused kernels are on and no gradient is needed (training keeps the eager functions);
inputs may be strided views whose last dim is contiguous. Left out: a backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import check_inputs, pow2, tl, triton


@triton.jit
def rms_norm_fwd(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    D,
    stride_x,
    eps,
    HAS_W: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    d = tl.arange(0, BD)
    ok = (n < N)[:, None] & (d < D)[None, :]
    n64 = n.to(tl.int64)
    x = tl.load(x_ptr + n64[:, None] * stride_x + d[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + n64[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotate(src, dst, cos, sin, h, ok, K2, src_head, dst_head, k):
    """Rotate heads h (rows of the tile) of one token: src/dst point at its head 0. The fused
    multiply-adds are spelled out (`rotate_pair`), so kernels that rotate their own tiles (the
    decode attention's prologue) round as this one does."""
    from_ = src + h[:, None] * src_head + k[None, :]
    x1 = tl.load(from_, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(from_ + K2, mask=ok, other=0.0).to(tl.float32)
    to = dst + h[:, None] * dst_head + k[None, :]
    tl.store(to, rotate_pair(x1, x2, cos, sin, True).to(dst.dtype.element_ty), mask=ok)
    tl.store(to + K2, rotate_pair(x2, x1, cos, sin, False).to(dst.dtype.element_ty), mask=ok)


@triton.jit
def rotate_pair(x, partner, cos, sin, first):
    """Rope's rotation of column x with its partner in the 'half' layout (x1 cos - x2 sin in
    the first half, x2 cos + x1 sin in the second), as explicit fused multiply-adds: left to
    the compiler, which product it fuses depends on the code around it."""
    return tl.where(first, tl.fma(x, cos, -(partner * sin)), tl.fma(x, cos, partner * sin))


@triton.jit
def _angles(cos_ptr, sin_ptr, token, K2, k):
    cos = tl.load(cos_ptr + token * K2 + k, mask=k < K2, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * K2 + k, mask=k < K2, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def rope_fwd(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    H,
    K2,
    stride_row,
    stride_head,
    BH: tl.constexpr,
    BK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    k = tl.arange(0, BK)
    ok = (h < H)[:, None] & (k < K2)[None, :]
    cos, sin = _angles(cos_ptr, sin_ptr, row, K2, k)
    _rotate(
        x_ptr + row * stride_row,
        y_ptr + row * (H * 2 * K2),
        cos,
        sin,
        h,
        ok,
        K2,
        stride_head,
        2 * K2,
        k,
    )


@triton.jit
def rope_cache_fwd(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    qo_ptr,
    kc_ptr,
    vc_ptr,
    rows_ptr,
    pos_ptr,
    T,
    H,
    G,
    K2,
    sq_a,
    sq_t,
    sq_h,
    sk_a,
    sk_t,
    sk_h,
    sv_a,
    sv_t,
    sv_h,
    sp_a,
    sp_t,
    skc_b,
    skc_g,
    skc_n,
    svc_b,
    svc_g,
    svc_n,
    BH: tl.constexpr,
    BK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # a * T + t
    a, t = token // T, token % T
    k = tl.arange(0, BK)
    h = tl.arange(0, BH)
    cos, sin = _angles(cos_ptr, sin_ptr, token, K2, k)
    ok_q = (h < H)[:, None] & (k < K2)[None, :]
    _rotate(
        q_ptr + a * sq_a + t * sq_t,
        qo_ptr + token * (H * 2 * K2),
        cos,
        sin,
        h,
        ok_q,
        K2,
        sq_h,
        2 * K2,
        k,
    )
    row = tl.load(rows_ptr + a).to(tl.int64)
    pos = tl.load(pos_ptr + a * sp_a + t * sp_t).to(tl.int64)
    ok_k = (h < G)[:, None] & (k < K2)[None, :]
    _rotate(
        k_ptr + a * sk_a + t * sk_t,
        kc_ptr + row * skc_b + pos * skc_n,
        cos,
        sin,
        h,
        ok_k,
        K2,
        sk_h,
        skc_g,
        k,
    )
    v_src = v_ptr + a * sv_a + t * sv_t + h[:, None] * sv_h + k[None, :]
    v_dst = vc_ptr + row * svc_b + pos * svc_n + h[:, None] * svc_g + k[None, :]
    tl.store(v_dst, tl.load(v_src, mask=ok_k, other=0.0), mask=ok_k)
    tl.store(v_dst + K2, tl.load(v_src + K2, mask=ok_k, other=0.0), mask=ok_k)


@triton.jit
def silu_mul_fwd(x_ptr, y_ptr, N, F, stride_x, BN: tl.constexpr, BF: tl.constexpr):
    """y = silu(gate) * up of x = [gate | up] rows (SwiGLU), in fp32."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    f = tl.program_id(1) * BF + tl.arange(0, BF)
    ok = (n < N)[:, None] & (f < F)[None, :]
    src = x_ptr + n.to(tl.int64)[:, None] * stride_x + f[None, :]
    gate = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(src + F, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + n.to(tl.int64)[:, None] * F + f[None, :], y.to(y_ptr.dtype.element_ty), ok)


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
        rms_norm_fwd[(-(-N // BN),)](
            x_ND,
            x_ND if weight is None else weight,
            y,
            N,
            D,
            x_ND.stride(0),
            eps,
            HAS_W=weight is not None,
            BN=BN,
            BD=BD,
            num_warps=4 if BD <= 4096 else 8,
        )
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
        rope_fwd[(B * T, -(-H // BH))](
            x_BTHK, cos, sin, y, H, K // 2, x_BTHK.stride(1), x_BTHK.stride(2), BH=BH, BK=BK
        )
    return y


@rope.register_fake
def _(x_BTHK, cos_BTK2, sin_BTK2):  # type: ignore[no-untyped-def]
    return torch.empty_like(x_BTHK, memory_format=torch.contiguous_format)


@torch.library.custom_op("birkhoff::rope_cache", mutates_args=("k_cache_BGNK", "v_cache_BGNK"))
def rope_cache(
    q_ATHK: Tensor,
    k_ATGK: Tensor,
    v_ATGK: Tensor,
    cos_ATK2: Tensor,
    sin_ATK2: Tensor,
    k_cache_BGNK: Tensor,
    v_cache_BGNK: Tensor,
    rows_A: Tensor,
    positions_AT: Tensor,
) -> Tensor:
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
        rope_cache_fwd[(A * T,)](
            q_ATHK,
            k_ATGK,
            v_ATGK,
            cos,
            sin,
            q_out,
            k_cache_BGNK,
            v_cache_BGNK,
            rows_A,
            positions_AT,
            T,
            H,
            G,
            K // 2,
            *q_ATHK.stride()[:3],
            *k_ATGK.stride()[:3],
            *v_ATGK.stride()[:3],
            *positions_AT.stride(),
            *k_cache_BGNK.stride()[:3],
            *v_cache_BGNK.stride()[:3],
            BH=max(2, pow2(max(H, G))),
            BK=max(16, pow2(K // 2)),
            num_warps=1 if max(H, G) * K <= 1024 else 4,
        )
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
        silu_mul_fwd[(-(-N // BN), -(-F // BF))](x_NF, y, N, F, x_NF.stride(0), BN=BN, BF=BF)
    return y


@silu_mul.register_fake
def _(gate_up):  # type: ignore[no-untyped-def]
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
