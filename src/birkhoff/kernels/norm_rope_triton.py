"""Triton kernels of the engine's per-token ops: RMSNorm and rotary embedding (forward only).

Legend: N rows (every leading dim flattened), D normalised dim, H heads (G kv heads), K head dim,
F MLP hidden.

Each replaces a chain of eager elementwise kernels (RMSNorm: upcast, square, mean, rsqrt, two
multiplies, downcast; rope: upcast of x, cos and sin, four multiplies, two adds, a cat, a
downcast) with one launch that reads its input once and writes its output once, computing in
fp32 as the eager functions do. At decode sizes these ops move a few kilobytes, so what they
cost is the number of launches, not bytes.
- `rms_norm_fwd`: [BN rows, BD >= D] tiles; y = x * rsqrt(mean(x^2) + eps) * w.
- `rope_fwd`: one program per (row, head block); the 'half' layout (x[:K/2], x[K/2:]) rotated by
  the row's angles, cos/sin read in their stored dtype (fp64 tables) and used in fp32.
- `rope_cache_fwd`: an attention layer's prologue, one program per token: rope of its query
  heads (written out) and of its key heads, written with its value heads straight into the
  KV cache at (cache row, position) (replaces two rope launches and two index_put launches).
- `silu_mul_fwd`: SwiGLU's silu(gate) * up read from the fused gate/up projection's rows (two
  strided elementwise launches before).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd(
    x_ptr, w_ptr, y_ptr, N, D, stride_x, eps,
    HAS_W: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
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
    x_ptr, cos_ptr, sin_ptr, y_ptr, H, K2, stride_row, stride_head,
    BH: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    k = tl.arange(0, BK)
    ok = (h < H)[:, None] & (k < K2)[None, :]
    cos, sin = _angles(cos_ptr, sin_ptr, row, K2, k)
    _rotate(x_ptr + row * stride_row, y_ptr + row * (H * 2 * K2), cos, sin, h, ok, K2,
            stride_head, 2 * K2, k)  # fmt: skip


@triton.jit
def rope_cache_fwd(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, rows_ptr, pos_ptr,
    T, H, G, K2, sq_a, sq_t, sq_h, sk_a, sk_t, sk_h, sv_a, sv_t, sv_h, sp_a, sp_t,
    skc_b, skc_g, skc_n, svc_b, svc_g, svc_n,
    BH: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)  # a * T + t
    a, t = token // T, token % T
    k = tl.arange(0, BK)
    h = tl.arange(0, BH)
    cos, sin = _angles(cos_ptr, sin_ptr, token, K2, k)
    ok_q = (h < H)[:, None] & (k < K2)[None, :]
    _rotate(q_ptr + a * sq_a + t * sq_t, qo_ptr + token * (H * 2 * K2), cos, sin, h, ok_q, K2,
            sq_h, 2 * K2, k)  # fmt: skip
    row = tl.load(rows_ptr + a).to(tl.int64)
    pos = tl.load(pos_ptr + a * sp_a + t * sp_t).to(tl.int64)
    ok_k = (h < G)[:, None] & (k < K2)[None, :]
    _rotate(k_ptr + a * sk_a + t * sk_t, kc_ptr + row * skc_b + pos * skc_n, cos, sin, h, ok_k,
            K2, sk_h, skc_g, k)  # fmt: skip
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
