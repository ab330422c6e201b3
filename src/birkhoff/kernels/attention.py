"""Decode attention as a fused forward-only custom op (`birkhoff::decode_attention`), for the
engine's decode, verify and draft steps: a few query tokens per row attend over that row's
cache slots, reading only its live prefix.

Legend: A active rows, T query tokens per row, H query heads, G kv heads, R = H / G, B cache
rows, N cache positions, K head dim.

The eager reference is `F.scaled_dot_product_attention` with the explicit mask `key position
<= query position` over slots 0..limit-1 (engine/forward.py). At decode sizes that call costs
what its key bucket costs: the mask's whole [A, 1, T, limit] and every row's keys up to the
bucket, live or not (at batch 256 it was a third of a step). This op instead stops each row at
its own last real position, splits long key ranges over programs (flash-decoding), and reads
the cache rows in place (no gather of `rows_A`). `birkhoff::decode_attention_rope` is the same
op with the layer's prologue folded in (rope of q and k, k and v into the cache:
`norm_rope.rope_cache`'s work, in the same arithmetic), one launch a layer where a decode,
draft or verify step had two.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import attention_triton as AT
from birkhoff.kernels.mhc_mix import check_inputs, pow2
from birkhoff.kernels.ops import INTERPRET

SPLIT = 256  # keys per program: fixed, so the result does not depend on `limit`
MAX_QUERIES = 128  # T * R per (row, kv head): one tile of query vectors in registers
# BN keys per block inside a program, and the launch; read at every call, so
# benchmarks/decode_attention.py can sweep it (H200, `decode_attention-cuda.json`: 2 warps beat
# 4 at every decode shape timed; 32 keys a block beat 64 by 9-12% at 88 positions, 1% at 400,
# and lose 3% at 2000)
CONFIG = dict(BN=32, num_warps=2, num_stages=3)
# `decode_attention_heads`' launch, for T = 1 and H = G from PAIRS (row, kv head) pairs a call
# up: HB kv heads a program, BN key columns a block (BN / HB keys of each head); HB 0: off. With
# rope, h200-small's 12 heads, graph-timed us a layer (`decode_attention-cuda-rope.json`): 256
# rows at 88 positions 21.7 against the per-head kernel's 25.9, 400 positions 82.3 / 86.9, 128
# rows 10.2 / 12.9; below ~100 rows it has too few programs (64 rows: 8.1 / 7.0, 1 row: 7.2 /
# 4.1). The choice depends on the batch, never on `limit`, so a CUDA graph's key bucket does not
# change a row's bits (its padded batch bucket may, as the GEMMs' tiles do)
HEADS = dict(HB=2, BN=32, num_warps=1, num_stages=2, PAIRS=1536)


@torch.library.custom_op("birkhoff::decode_attention", mutates_args=())
def decode_attention(
    q_ATHK: Tensor, k_BGNK: Tensor, v_BGNK: Tensor, rows_A: Tensor, positions_AT: Tensor,
    valid_AT: Tensor, limit: int,
) -> Tensor:  # fmt: skip
    """softmax(q k^T / sqrt(K)) v per row over its cache row `rows_A[a]`: token t of row a sees
    the keys at positions <= positions_AT[a, t] and < limit; a row's padded tokens (valid_AT
    False) are ignored when the row's key range is found (their outputs are unspecified).
    Returns [A, T, H, K] in q's dtype."""
    return _attend(q_ATHK, k_BGNK, v_BGNK, rows_A, positions_AT, valid_AT, limit, None)


@torch.library.custom_op("birkhoff::decode_attention_rope", mutates_args=("k_BGNK", "v_BGNK"))
def decode_attention_rope(
    q_ATHK: Tensor, k_ATGK: Tensor, v_ATGK: Tensor, cos_ATK2: Tensor, sin_ATK2: Tensor,
    k_BGNK: Tensor, v_BGNK: Tensor, rows_A: Tensor, positions_AT: Tensor, valid_AT: Tensor,
    limit: int,
) -> Tensor:  # fmt: skip
    """`norm_rope.rope_cache` then `decode_attention` in one launch, for a chunk of decode size
    (a decode, draft or verify step): q and k are the tokens' raw projections (views of the
    fused qkv projection may be passed), rotated here; k and v are written into the caches at
    (rows_A[a], positions_AT[a, t]) for real tokens at positions < limit (a padded token writes
    nothing: rope_cache would write it to the trash slot, which no query reads)."""
    A, T, H, K = q_ATHK.shape
    G = k_ATGK.shape[2]
    if K % 2 or k_ATGK.shape != (A, T, G, K) or v_ATGK.shape != (A, T, G, K):
        raise ValueError(f"decode_attention_rope: the chunk's q, k and v with an even head dim, "
                         f"got q {tuple(q_ATHK.shape)}, k {tuple(k_ATGK.shape)}, "
                         f"v {tuple(v_ATGK.shape)}")  # fmt: skip
    if cos_ATK2.shape != (A, T, K // 2) or sin_ATK2.shape != cos_ATK2.shape:
        raise ValueError(f"decode_attention_rope: angles {tuple(cos_ATK2.shape)} / "
                         f"{tuple(sin_ATK2.shape)}, expected {(A, T, K // 2)}")  # fmt: skip
    check_inputs(k_ATGK, v_ATGK)
    if k_ATGK.stride(-1) != 1 or v_ATGK.stride(-1) != 1:
        raise ValueError("decode_attention_rope: the new k and v need a contiguous head dim")
    rope = (k_ATGK, v_ATGK, cos_ATK2.contiguous(), sin_ATK2.contiguous())
    return _attend(q_ATHK, k_BGNK, v_BGNK, rows_A, positions_AT, valid_AT, limit, rope)


def heads_kernel(A: int, T: int, H: int, G: int) -> bool:
    """Whether `decode_attention_heads` serves A rows of T tokens with H query and G kv heads."""
    return T == 1 and H == G and bool(HEADS["HB"]) and HEADS["PAIRS"] <= A * G


def _attend(
    q_ATHK: Tensor, k_BGNK: Tensor, v_BGNK: Tensor, rows_A: Tensor, positions_AT: Tensor,
    valid_AT: Tensor, limit: int, rope: tuple[Tensor, Tensor, Tensor, Tensor] | None,
) -> Tensor:  # fmt: skip
    check_inputs(q_ATHK, k_BGNK, v_BGNK)
    A, T, H, K = q_ATHK.shape
    G = k_BGNK.shape[1]
    if H % G or k_BGNK.shape[-1] != K or v_BGNK.shape != k_BGNK.shape:
        raise ValueError(f"decode_attention: q {tuple(q_ATHK.shape)} vs cache "
                         f"{tuple(k_BGNK.shape)} / {tuple(v_BGNK.shape)}")  # fmt: skip
    if limit > k_BGNK.shape[2]:
        raise ValueError(f"decode_attention: limit {limit} exceeds {k_BGNK.shape[2]} positions")
    if T * (H // G) > MAX_QUERIES:
        raise ValueError(f"decode_attention: T * H / G = {T * H // G} > {MAX_QUERIES}")
    if q_ATHK.stride(-1) != 1:
        q_ATHK = q_ATHK.contiguous()
    if k_BGNK.stride(-1) != 1 or v_BGNK.stride(-1) != 1:
        raise ValueError("decode_attention: the cache's head dim must be contiguous")
    R = H // G
    out = torch.empty((A, T, H, K), dtype=q_ATHK.dtype, device=q_ATHK.device)
    P = max(1, -(-limit // SPLIT))
    direct = P == 1
    part = out if direct else torch.empty((A, T, H, P, K), dtype=torch.float32, device=out.device)
    stat = out if direct else torch.empty((A, T, H, P, 2), dtype=torch.float32, device=out.device)
    BK = max(16, pow2(K))
    precision = "ieee" if q_ATHK.dtype == torch.float32 else "tf32"
    k_new, v_new, cos, sin = rope or (q_ATHK,) * 4  # unread without rope
    if A * T and heads_kernel(A, T, H, G):
        launch = {k: v for k, v in HEADS.items() if k != "PAIRS"}
        hb = launch.pop("HB")
        if hb & (hb - 1) or launch["BN"] % hb:
            raise ValueError(f"decode_attention: HEADS HB {hb} must be a power of two dividing "
                             f"BN {launch['BN']}")  # fmt: skip
        AT.decode_attention_heads[(A * -(-G // hb), P)](
            q_ATHK, k_BGNK, v_BGNK, rows_A, positions_AT, valid_AT, out, part, stat,
            k_new, v_new, cos, sin,
            G, K, limit, K**-0.5, P, positions_AT.stride(0), valid_AT.stride(0),
            q_ATHK.stride(0), q_ATHK.stride(2),
            k_BGNK.stride(0), k_BGNK.stride(1), k_BGNK.stride(2),
            v_BGNK.stride(0), v_BGNK.stride(1), v_BGNK.stride(2),
            k_new.stride(0), k_new.stride(2), v_new.stride(0), v_new.stride(2),
            SPLIT=SPLIT, HB=hb, BM=max(16, pow2(hb)), BK=BK, DIRECT=direct, PRECISION=precision,
            DOT_FP32=INTERPRET, ROPE=rope is not None, **launch,
        )  # fmt: skip
    elif A * T:
        AT.decode_attention_fwd[(A * G, P)](
            q_ATHK, k_BGNK, v_BGNK, rows_A, positions_AT, valid_AT, out, part, stat,
            k_new, v_new, cos, sin,
            T, R, G, H, K, limit, K**-0.5, P,
            positions_AT.stride(0), positions_AT.stride(1), valid_AT.stride(0), valid_AT.stride(1),
            q_ATHK.stride(0), q_ATHK.stride(1), q_ATHK.stride(2),
            k_BGNK.stride(0), k_BGNK.stride(1), k_BGNK.stride(2),
            v_BGNK.stride(0), v_BGNK.stride(1), v_BGNK.stride(2),
            k_new.stride(0), k_new.stride(1), k_new.stride(2),
            v_new.stride(0), v_new.stride(1), v_new.stride(2),
            SPLIT=SPLIT, BM=max(16, pow2(T * R)), BK=BK, BT=max(2, pow2(T)),
            DIRECT=direct, PRECISION=precision,
            DOT_FP32=INTERPRET, ROPE=rope is not None, **CONFIG,
        )  # fmt: skip
    if A * T and not direct:
        AT.decode_attention_combine[(A * T * H,)](
            part, stat, out, P, K, BP=max(2, pow2(P)), BK=BK, num_warps=1 if K <= 64 else 2
        )
    return out


@decode_attention.register_fake
def _(q_ATHK, k_BGNK, v_BGNK, rows_A, positions_AT, valid_AT, limit):  # type: ignore[no-untyped-def]
    return torch.empty_like(q_ATHK, memory_format=torch.contiguous_format)


@decode_attention_rope.register_fake
def _(q_ATHK, k_ATGK, v_ATGK, cos, sin, k_BGNK, v_BGNK, rows_A, positions, valid, limit):  # type: ignore[no-untyped-def]  # noqa: E501
    return torch.empty_like(q_ATHK, memory_format=torch.contiguous_format)
