"""Decode attention as fused forward-only custom ops (`birkhoff::decode_attention`,
`birkhoff::decode_attention_rope`): a few query tokens per row attend over that row's cache.

Legend: A active rows, T query tokens per row, H query heads, G kv heads, R = H / G query heads
per kv head, M = T * R query vectors of one (row, kv head), B cache rows, N cache positions,
K head dim, P splits of the key range.

The eager reference is `F.scaled_dot_product_attention` with the mask `key position <= query
position` (engine/forward.py). Each row stops at its own last real position, long key ranges
split over programs (flash-decoding) at fixed key positions, so the result does not depend on
the key bucket; the rope variant folds the layer's prologue (rope, k and v into the cache) in.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import INTERPRET, check_inputs, pow2, tl, triton
from birkhoff.kernels.norm_rope import rotate_pair


@triton.jit
def _angles(cos_ptr, sin_ptr, token, d, K2):
    """cos and sin [BK] of one token's angles ([tokens, K2] tables) for head-dim columns d (the
    'half' layout: columns d and d + K2 share angle d), in fp32."""
    j = tl.where(d < K2, d, d - K2)
    ok = j < K2
    cos = tl.load(cos_ptr + token * K2 + j, mask=ok, other=0.0).to(tl.float32)
    return cos, tl.load(sin_ptr + token * K2 + j, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _rotated(x_ptr, head, d, ok, K2, cos, sin):
    """Columns d of the heads at x_ptr + head rotated by (cos, sin) in the 'half' layout, in
    fp32, column by column, with rope_cache's arithmetic (`rotate_pair`)."""
    first = d < K2
    x = tl.load(x_ptr + head + d, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + head + tl.where(first, d + K2, d - K2), mask=ok, other=0.0)
    xp = xp.to(tl.float32)
    return rotate_pair(x, xp, cos, sin, first)


@triton.jit
def _cache_new(kn_ptr, kn_head, vn_rows, k_dst, v_dst, d, ok, writes, K2, cos, sin):
    """New keys (heads at kn_ptr + kn_head, rotated) and values (at vn_rows) in the cache's
    dtypes, columns d where `ok`; stored at k_dst + d / v_dst + d where `writes`."""
    k_new = _rotated(kn_ptr, kn_head, d, ok, K2, cos, sin).to(k_dst.dtype.element_ty)
    v_new = tl.load(vn_rows + d, mask=ok, other=0.0).to(v_dst.dtype.element_ty)
    tl.store(k_dst + d, k_new, mask=writes)
    tl.store(v_dst + d, v_new, mask=writes)
    return k_new, v_new


@triton.jit
def _attend_block(q, k_col, v_row, n_ok, seen, d, d_ok, scale, acc, m_i, l_i, PRECISION, DOT_FP32):
    """One block of keys (pointers k_col [1, BN] / v_row [BN, 1] to their head dims, read where
    n_ok; scores kept where `seen`) scored against q; the online softmax of the scores, then
    acc rescaled plus p v. Returns (acc, running max, running sum)."""
    kt = tl.load(k_col + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    if DOT_FP32:
        kt = kt.to(tl.float32)
    scores = tl.dot(q, kt, input_precision=PRECISION) * scale
    scores = tl.where(n_ok[None, :] & seen, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    v = tl.load(v_row + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _write(out_ptr, part_ptr, stat_ptr, o_row, acc, m_i, l_i, m_ok, d, d_ok, s, P, K, DIRECT):
    """The normalised output (one split) or the split's accumulator, max and sum."""
    ok = m_ok[:, None] & d_ok[None, :]
    if DIRECT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + o_row[:, None] * K + d[None, :], out.to(out_ptr.dtype.element_ty), ok)
    else:
        tl.store(part_ptr + (o_row[:, None] * P + s) * K + d[None, :], acc, mask=ok)
        tl.store(stat_ptr + (o_row * P + s) * 2, m_i, mask=m_ok)
        tl.store(stat_ptr + (o_row * P + s) * 2 + 1, l_i, mask=m_ok)


@triton.jit
def decode_attention_fwd(
    q_ptr,
    k_ptr,
    v_ptr,
    rows_ptr,
    pos_ptr,
    valid_ptr,
    out_ptr,
    part_ptr,
    stat_ptr,
    kn_ptr,
    vn_ptr,
    cos_ptr,
    sin_ptr,
    T,
    R,
    G,
    H,
    K,
    limit,
    scale,
    P,
    sp_a,
    sp_t,
    sr_a,
    sr_t,
    sq_a,
    sq_t,
    sq_h,
    sk_b,
    sk_g,
    sk_n,
    sv_b,
    sv_g,
    sv_n,
    skn_a,
    skn_t,
    skn_g,
    svn_a,
    svn_t,
    svn_g,
    SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROPE: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    a, g = pid // G, pid % G
    t_all = tl.arange(0, BT)
    pos_t = tl.load(pos_ptr + a * sp_a + t_all * sp_t, mask=t_all < T, other=0)
    real_t = tl.load(valid_ptr + a * sr_a + t_all * sr_t, mask=t_all < T, other=0) != 0
    end = tl.minimum(tl.max(tl.where(real_t, pos_t + 1, 0), axis=0), limit)
    lo = s * SPLIT
    hi = tl.minimum(lo + SPLIT, end)

    m = tl.arange(0, BM)
    t_m, r_m = m // R, m % R
    m_ok = m < T * R
    qpos = tl.load(pos_ptr + a * sp_a + t_m * sp_t, mask=m_ok, other=0)
    d = tl.arange(0, BK)
    d_ok = d < K
    q_head = a.to(tl.int64) * sq_a + t_m[:, None] * sq_t + (g * R + r_m)[:, None] * sq_h
    q_ok = m_ok[:, None] & d_ok[None, :]
    row = tl.load(rows_ptr + a).to(tl.int64)
    k_base = k_ptr + row * sk_b + g * sk_g
    v_base = v_ptr + row * sv_b + g * sv_g
    if ROPE:  # rope_cache's work first, then the same walk over the cache
        # every program rotates the chunk's keys (their loads need not wait for the positions);
        # the program whose split holds a position stores that key and value there (no other
        # program reads it), and the barrier orders those stores before the walk's loads
        a64 = a.to(tl.int64)
        cos, sin = _angles(cos_ptr, sin_ptr, (a64 * T + t_all)[:, None], d[None, :], K // 2)
        kn_head = (a64 * skn_a + t_all * skn_t + g * skn_g)[:, None]
        vn_rows = vn_ptr + (a64 * svn_a + t_all * svn_t + g * svn_g)[:, None]
        new_ok = (t_all < T)[:, None] & d_ok[None, :]
        own = (real_t & (pos_t < limit) & (pos_t // SPLIT == s))[:, None] & d_ok[None, :]
        slot = pos_t.to(tl.int64)[:, None]
        k_dst, v_dst = k_base + slot * sk_n, v_base + slot * sv_n
        _cache_new(
            kn_ptr, kn_head, vn_rows, k_dst, v_dst, d[None, :], new_ok, own, K // 2, cos, sin
        )
        cos_m, sin_m = _angles(cos_ptr, sin_ptr, (a64 * T + t_m)[:, None], d[None, :], K // 2)
        q = _rotated(q_ptr, q_head, d[None, :], q_ok, K // 2, cos_m, sin_m)
        q = q.to(q_ptr.dtype.element_ty)
        tl.debug_barrier()
    else:
        q = tl.load(q_ptr + q_head + d[None, :], mask=q_ok, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    acc = tl.zeros([BM, BK], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    for start in range(lo, hi, BN):
        n = start + tl.arange(0, BN)
        k_col = k_base + n[None, :].to(tl.int64) * sk_n
        v_row = v_base + n[:, None].to(tl.int64) * sv_n
        seen = n[None, :] <= qpos[:, None]
        acc, m_i, l_i = _attend_block(
            q, k_col, v_row, n < hi, seen, d, d_ok, scale, acc, m_i, l_i, PRECISION, DOT_FP32
        )

    # output and partials are [A, T, H, (P,) K]: query vector m is token t_m, head g*R + r_m
    o_row = (a.to(tl.int64) * T + t_m) * H + g * R + r_m
    _write(out_ptr, part_ptr, stat_ptr, o_row, acc, m_i, l_i, m_ok, d, d_ok, s, P, K, DIRECT)


@triton.jit
def decode_attention_heads(
    q_ptr,
    k_ptr,
    v_ptr,
    rows_ptr,
    pos_ptr,
    valid_ptr,
    out_ptr,
    part_ptr,
    stat_ptr,
    kn_ptr,
    vn_ptr,
    cos_ptr,
    sin_ptr,
    G,
    K,
    limit,
    scale,
    P,
    sp_a,
    sr_a,
    sq_a,
    sq_h,
    sk_b,
    sk_g,
    sk_n,
    sv_b,
    sv_g,
    sv_n,
    skn_a,
    skn_g,
    svn_a,
    svn_g,
    SPLIT: tl.constexpr,
    HB: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROPE: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    blocks = tl.cdiv(G, HB)
    a, g0 = pid // blocks, (pid % blocks) * HB
    a64 = a.to(tl.int64)
    qpos = tl.load(pos_ptr + a * sp_a)
    real = tl.load(valid_ptr + a * sr_a) != 0
    lo = s * SPLIT
    hi = tl.minimum(tl.minimum(lo + SPLIT, tl.where(real, qpos + 1, 0)), limit)

    m = tl.arange(0, BM)
    h_m = g0 + m
    m_ok = (m < HB) & (h_m < G)
    d = tl.arange(0, BK)
    d_ok = d < K
    q_ok = m_ok[:, None] & d_ok[None, :]
    row = tl.load(rows_ptr + a).to(tl.int64)
    acc = tl.zeros([BM, BK], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    if ROPE:  # the token's own key, rotated here, is the first key of the split holding it
        cos, sin = _angles(cos_ptr, sin_ptr, a64, d[None, :], K // 2)
        q = _rotated(q_ptr, a64 * sq_a + h_m[:, None] * sq_h, d[None, :], q_ok, K // 2, cos, sin)
        q = q.to(q_ptr.dtype.element_ty)
        first = real & (qpos < limit) & (qpos // SPLIT == s)
        writes = tl.where(first, q_ok, False)  # (the interpreter's scalar & gives an int mask)
        h64, pos64 = h_m[:, None].to(tl.int64), qpos.to(tl.int64)
        k_dst = k_ptr + row * sk_b + h64 * sk_g + pos64 * sk_n
        v_dst = v_ptr + row * sv_b + h64 * sv_g + pos64 * sv_n
        kn_head = a64 * skn_a + h_m[:, None] * skn_g
        vn_rows = vn_ptr + a64 * svn_a + h_m[:, None] * svn_g
        k_new, v_new = _cache_new(
            kn_ptr, kn_head, vn_rows, k_dst, v_dst, d[None, :], q_ok, writes, K // 2, cos, sin
        )
        hi = tl.minimum(hi, qpos)  # the cached keys before it: no load waits for the store
        own_score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * scale
        m_i = tl.where(first, own_score, m_i)
        l_i = tl.where(first, 1.0, l_i)
        acc = tl.where(first, v_new.to(tl.float32), acc)
    else:
        q_off = a64 * sq_a + h_m[:, None] * sq_h + d[None, :]
        q = tl.load(q_ptr + q_off, mask=q_ok, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    c = tl.arange(0, BN)  # key column: head g0 + c // (BN // HB), key c % (BN // HB)
    h_c = g0 + c // (BN // HB)
    own = h_m[:, None] == h_c[None, :]
    k_base = k_ptr + row * sk_b + h_c.to(tl.int64) * sk_g
    v_base = v_ptr + row * sv_b + h_c.to(tl.int64) * sv_g
    for start in range(lo, hi, BN // HB):
        n = start + c % (BN // HB)
        k_col = k_base[None, :] + n[None, :].to(tl.int64) * sk_n
        v_row = v_base[:, None] + n[:, None].to(tl.int64) * sv_n
        n_ok = (n < hi) & (h_c < G)
        acc, m_i, l_i = _attend_block(
            q, k_col, v_row, n_ok, own, d, d_ok, scale, acc, m_i, l_i, PRECISION, DOT_FP32
        )

    o_row = a.to(tl.int64) * G + h_m  # [A, 1, H, (P,) K]
    _write(out_ptr, part_ptr, stat_ptr, o_row, acc, m_i, l_i, m_ok, d, d_ok, s, P, K, DIRECT)


@triton.jit
def decode_attention_combine(part_ptr, stat_ptr, out_ptr, P, K, BP: tl.constexpr, BK: tl.constexpr):
    o_row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BP)
    d = tl.arange(0, BK)
    s_ok = s < P
    m_s = tl.load(stat_ptr + (o_row * P + s) * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(stat_ptr + (o_row * P + s) * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m_s, axis=0)
    w_s = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_max))
    acc = tl.load(
        part_ptr + (o_row * P + s[:, None]) * K + d[None, :],
        mask=s_ok[:, None] & (d < K)[None, :],
        other=0.0,
    )
    total = tl.sum(acc * w_s[:, None], axis=0)
    norm = tl.sum(l_s * w_s, axis=0)
    out = total / tl.where(norm == 0.0, 1.0, norm)
    tl.store(out_ptr + o_row * K + d, out.to(out_ptr.dtype.element_ty), mask=d < K)


SPLIT = 256  # keys per program: fixed, so the result does not depend on `limit`
MAX_QUERIES = 128  # T * R per (row, kv head): one tile of query vectors in registers
# BN keys per block inside a program, and the launch; read at every call, so
# benchmarks/decode_attention.py can sweep it (the measurements: docs/log/kernels.md)
CONFIG = dict(BN=32, num_warps=2, num_stages=3)
# `decode_attention_heads`' launch, for T = 1 and H = G from PAIRS (row, kv head) pairs a call
# up: HB kv heads a program, BN key columns a block (BN / HB keys of each head); HB 0: off. It
# wins from about a hundred rows; below, it has too few programs (docs/log/kernels.md). The
# choice depends on the batch, never on `limit`, so a CUDA graph's key bucket does not
# change a row's bits (its padded batch bucket may, as the GEMMs' tiles do)
HEADS = dict(HB=2, BN=32, num_warps=1, num_stages=2, PAIRS=1536)


@torch.library.custom_op("birkhoff::decode_attention", mutates_args=())
def decode_attention(
    q_ATHK: Tensor,
    k_BGNK: Tensor,
    v_BGNK: Tensor,
    rows_A: Tensor,
    positions_AT: Tensor,
    valid_AT: Tensor,
    limit: int,
) -> Tensor:
    """softmax(q k^T / sqrt(K)) v per row over its cache row `rows_A[a]`: token t of row a sees
    the keys at positions <= positions_AT[a, t] and < limit; a row's padded tokens (valid_AT
    False) are ignored when the row's key range is found (their outputs are unspecified).
    Returns [A, T, H, K] in q's dtype."""
    return _attend(q_ATHK, k_BGNK, v_BGNK, rows_A, positions_AT, valid_AT, limit, None)


@torch.library.custom_op("birkhoff::decode_attention_rope", mutates_args=("k_BGNK", "v_BGNK"))
def decode_attention_rope(
    q_ATHK: Tensor,
    k_ATGK: Tensor,
    v_ATGK: Tensor,
    cos_ATK2: Tensor,
    sin_ATK2: Tensor,
    k_BGNK: Tensor,
    v_BGNK: Tensor,
    rows_A: Tensor,
    positions_AT: Tensor,
    valid_AT: Tensor,
    limit: int,
) -> Tensor:
    """`norm_rope.rope_cache` then `decode_attention` in one launch, for a chunk of decode size
    (a decode, draft or verify step): q and k are the tokens' raw projections (views of the
    fused qkv projection may be passed), rotated here; k and v are written into the caches at
    (rows_A[a], positions_AT[a, t]) for real tokens at positions < limit (a padded token writes
    nothing: rope_cache would write it to the trash slot, which no query reads)."""
    A, T, H, K = q_ATHK.shape
    G = k_ATGK.shape[2]
    if K % 2 or k_ATGK.shape != (A, T, G, K) or v_ATGK.shape != (A, T, G, K):
        raise ValueError(
            f"decode_attention_rope: the chunk's q, k and v with an even head dim, "
            f"got q {tuple(q_ATHK.shape)}, k {tuple(k_ATGK.shape)}, "
            f"v {tuple(v_ATGK.shape)}"
        )
    if cos_ATK2.shape != (A, T, K // 2) or sin_ATK2.shape != cos_ATK2.shape:
        raise ValueError(
            f"decode_attention_rope: angles {tuple(cos_ATK2.shape)} / "
            f"{tuple(sin_ATK2.shape)}, expected {(A, T, K // 2)}"
        )
    check_inputs(k_ATGK, v_ATGK)
    if k_ATGK.stride(-1) != 1 or v_ATGK.stride(-1) != 1:
        raise ValueError("decode_attention_rope: the new k and v need a contiguous head dim")
    rope = (k_ATGK, v_ATGK, cos_ATK2.contiguous(), sin_ATK2.contiguous())
    return _attend(q_ATHK, k_BGNK, v_BGNK, rows_A, positions_AT, valid_AT, limit, rope)


def heads_kernel(A: int, T: int, H: int, G: int) -> bool:
    """Whether `decode_attention_heads` serves A rows of T tokens with H query and G kv heads."""
    return T == 1 and H == G and bool(HEADS["HB"]) and HEADS["PAIRS"] <= A * G


def _checked_query(q_ATHK: Tensor, k_BGNK: Tensor, v_BGNK: Tensor, limit: int) -> Tensor:
    """q with a contiguous head dim, after the checks of the query against the caches."""
    check_inputs(q_ATHK, k_BGNK, v_BGNK)
    _, T, H, K = q_ATHK.shape
    G = k_BGNK.shape[1]
    if H % G or k_BGNK.shape[-1] != K or v_BGNK.shape != k_BGNK.shape:
        raise ValueError(
            f"decode_attention: q {tuple(q_ATHK.shape)} vs cache "
            f"{tuple(k_BGNK.shape)} / {tuple(v_BGNK.shape)}"
        )
    if limit > k_BGNK.shape[2]:
        raise ValueError(f"decode_attention: limit {limit} exceeds {k_BGNK.shape[2]} positions")
    if T * (H // G) > MAX_QUERIES:
        raise ValueError(f"decode_attention: T * H / G = {T * H // G} > {MAX_QUERIES}")
    if k_BGNK.stride(-1) != 1 or v_BGNK.stride(-1) != 1:
        raise ValueError("decode_attention: the cache's head dim must be contiguous")
    return q_ATHK if q_ATHK.stride(-1) == 1 else q_ATHK.contiguous()


def _attend(
    q_ATHK: Tensor,
    k_BGNK: Tensor,
    v_BGNK: Tensor,
    rows_A: Tensor,
    positions_AT: Tensor,
    valid_AT: Tensor,
    limit: int,
    rope: tuple[Tensor, Tensor, Tensor, Tensor] | None,
) -> Tensor:
    q_ATHK = _checked_query(q_ATHK, k_BGNK, v_BGNK, limit)
    A, T, H, K = q_ATHK.shape
    G = k_BGNK.shape[1]
    out = torch.empty((A, T, H, K), dtype=q_ATHK.dtype, device=q_ATHK.device)
    P = max(1, -(-limit // SPLIT))
    direct = P == 1
    part = out if direct else torch.empty((A, T, H, P, K), dtype=torch.float32, device=out.device)
    stat = out if direct else torch.empty((A, T, H, P, 2), dtype=torch.float32, device=out.device)
    k_new, v_new, cos, sin = rope or (q_ATHK,) * 4  # unread without rope
    cache = (q_ATHK, k_BGNK, v_BGNK, rows_A, positions_AT, valid_AT)
    tensors = (*cache, out, part, stat, k_new, v_new, cos, sin)
    consts = dict(
        SPLIT=SPLIT,
        BK=max(16, pow2(K)),
        DIRECT=direct,
        PRECISION="ieee" if q_ATHK.dtype == torch.float32 else "tf32",
        DOT_FP32=INTERPRET,
        ROPE=rope is not None,
    )
    if A * T and heads_kernel(A, T, H, G):
        _launch_heads(tensors, limit, P, consts)
    elif A * T:
        _launch_rows(tensors, limit, P, consts)
    if A * T and not direct:
        decode_attention_combine[(A * T * H,)](
            part,
            stat,
            out,
            P,
            K,
            BP=max(2, pow2(P)),
            BK=consts["BK"],
            num_warps=1 if K <= 64 else 2,
        )
    return out


def _launch_heads(tensors: tuple[Tensor, ...], limit: int, P: int, consts: dict) -> None:
    """`decode_attention_heads` over A rows of one token, HEADS["HB"] kv heads a program."""
    q_ATHK, k_BGNK, v_BGNK, _, positions_AT, valid_AT, *_, k_new, v_new, _, _ = tensors
    A, _, _, K = q_ATHK.shape
    G = k_BGNK.shape[1]
    launch = {k: v for k, v in HEADS.items() if k != "PAIRS"}
    hb = launch.pop("HB")
    if hb & (hb - 1) or launch["BN"] % hb:
        raise ValueError(
            f"decode_attention: HEADS HB {hb} must be a power of two dividing BN {launch['BN']}"
        )
    decode_attention_heads[(A * -(-G // hb), P)](
        *tensors,
        G,
        K,
        limit,
        K**-0.5,
        P,
        positions_AT.stride(0),
        valid_AT.stride(0),
        q_ATHK.stride(0),
        q_ATHK.stride(2),
        *k_BGNK.stride()[:3],
        *v_BGNK.stride()[:3],
        k_new.stride(0),
        k_new.stride(2),
        v_new.stride(0),
        v_new.stride(2),
        HB=hb,
        BM=max(16, pow2(hb)),
        **consts,
        **launch,
    )


def _launch_rows(tensors: tuple[Tensor, ...], limit: int, P: int, consts: dict) -> None:
    """`decode_attention_fwd`: one program a (row, kv head) and key split."""
    q_ATHK, k_BGNK, v_BGNK, _, positions_AT, valid_AT, *_, k_new, v_new, _, _ = tensors
    A, T, H, K = q_ATHK.shape
    G = k_BGNK.shape[1]
    R = H // G
    decode_attention_fwd[(A * G, P)](
        *tensors,
        T,
        R,
        G,
        H,
        K,
        limit,
        K**-0.5,
        P,
        *positions_AT.stride()[:2],
        *valid_AT.stride()[:2],
        *q_ATHK.stride()[:3],
        *k_BGNK.stride()[:3],
        *v_BGNK.stride()[:3],
        *k_new.stride()[:3],
        *v_new.stride()[:3],
        BM=max(16, pow2(T * R)),
        BT=max(2, pow2(T)),
        **consts,
        **CONFIG,
    )


@decode_attention.register_fake
def _(q_ATHK, k_BGNK, v_BGNK, rows_A, positions_AT, valid_AT, limit):  # type: ignore[no-untyped-def]
    return torch.empty_like(q_ATHK, memory_format=torch.contiguous_format)


@decode_attention_rope.register_fake
def _(q_ATHK, k_ATGK, v_ATGK, cos, sin, k_BGNK, v_BGNK, rows_A, positions, valid, limit):  # type: ignore[no-untyped-def]  # noqa: E501
    return torch.empty_like(q_ATHK, memory_format=torch.contiguous_format)
