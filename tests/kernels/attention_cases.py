"""Checks of the fused decode attention (birkhoff.kernels.attention) against SDPA with the
engine's explicit mask, on any device: CPU under the Triton interpreter
(attention_interpret_cases.py) and CUDA (test_attention_gpu.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # absolute, outputs are O(1)
# (dtype, T, H, G, K, rows in the cache, capacity, limit): decode (T=1), verify (T=3), GQA,
# odd head dims, several splits (limit > 256) and a limit below some rows' positions
CASES = [
    (torch.float32, 1, 4, 4, 16, 5, 40, 33),
    (torch.float32, 3, 8, 2, 24, 4, 64, 50),
    (torch.float32, 1, 6, 3, 64, 3, 700, 600),
    (torch.bfloat16, 1, 4, 4, 64, 6, 300, 130),
    (torch.bfloat16, 3, 6, 2, 64, 4, 600, 530),
    (torch.bfloat16, 2, 2, 1, 128, 3, 300, 290),
    (torch.float32, 16, 4, 2, 32, 4, 80, 40),  # a short prompt's prefill chunk (M = 32)
    (torch.float32, 1, 6, 6, 48, 4, 700, 600),  # heads kernel: a partial head block, 3 splits
]


def case_id(case: tuple) -> str:
    dt, T, H, G, K, B, N, limit = case
    return f"{str(dt)[6:]}-T{T}-H{H}G{G}-K{K}-N{limit}"


def reference(q_ATHK, k_BGNK, v_BGNK, rows_A, positions_AT, limit):  # type: ignore[no-untyped-def]
    """The engine's eager attention (engine/forward.py): SDPA over slots 0..limit-1."""
    H, G = q_ATHK.shape[2], k_BGNK.shape[1]
    k, v = k_BGNK[rows_A, :, :limit], v_BGNK[rows_A, :, :limit]
    keys_N = torch.arange(limit, device=q_ATHK.device)
    mask_A1TN = (keys_N[None, None, :] <= positions_AT[:, :, None])[:, None]
    out = F.scaled_dot_product_attention(
        q_ATHK.transpose(1, 2), k, v, attn_mask=mask_A1TN, enable_gqa=H != G
    )
    return out.transpose(1, 2)


def make_case(device: str, case: tuple, seed: int = 0):  # type: ignore[no-untyped-def]
    """q, the cache (a layer view of a [L, B, G, N, K] tensor), rows, positions and validity as
    a step has them: consecutive positions per row ending below `limit`, one padded token."""
    dt, T, H, G, K, B, N, limit = case
    g = torch.Generator().manual_seed(seed)
    A = B - 1
    q = torch.randn(A, T, H, K, generator=g).to(dt).to(device)
    kv = (2 * torch.randn(2, 2, B, G, N, K, generator=g)).to(dt).to(device)
    k_BGNK, v_BGNK = kv[0, 1], kv[1, 1]
    rows_A = torch.randperm(B, generator=g)[:A].to(device)
    starts = torch.randint(0, limit - T + 1, (A,), generator=g)
    starts[0] = limit - T  # one row reaches the limit
    positions_AT = (starts[:, None] + torch.arange(T)).to(device)
    valid_AT = torch.ones(A, T, dtype=torch.bool, device=device)
    if T > 1:  # padded tokens: the trash slot, ignored for the row's key range
        pad = max(1, T // 4)
        valid_AT[1, -pad:] = False
        positions_AT[1, -pad:] = N - 1
    return q, k_BGNK, v_BGNK, rows_A, positions_AT, valid_AT, limit


def check_decode_attention(device: str, case: tuple) -> None:
    from birkhoff.kernels.attention import decode_attention

    q, k, v, rows_A, positions_AT, valid_AT, limit = make_case(device, case)
    with torch.no_grad():
        got = decode_attention(q, k, v, rows_A, positions_AT, valid_AT, limit)
        want = reference(q, k, v, rows_A, positions_AT, limit)
    assert got.shape == want.shape and got.dtype == want.dtype
    real = valid_AT[:, :, None, None].expand_as(got)
    err = (got.float() - want.float())[real].abs().max().item()
    assert err <= TOL[q.dtype], err


def check_limit_independent(device: str, case: tuple) -> None:
    """The same rows with a larger key bucket (a CUDA graph's) give the same bits."""
    from birkhoff.kernels.attention import decode_attention

    q, k, v, rows_A, positions_AT, valid_AT, limit = make_case(device, case)
    with torch.no_grad():
        base = decode_attention(q, k, v, rows_A, positions_AT, valid_AT, limit)
        for bigger in (limit + 1, k.shape[2] - 1):
            wider = decode_attention(q, k, v, rows_A, positions_AT, valid_AT, bigger)
            assert torch.equal(base[valid_AT], wider[valid_AT]), bigger


def check_strided_positions(device: str, case: tuple) -> None:
    """Positions and validity as a verify step builds them: a broadcast live flag (stride 0
    along T) and positions in another memory order."""
    from birkhoff.kernels.attention import decode_attention

    q, k, v, rows_A, positions_AT, valid_AT, limit = make_case(device, case)
    A, T = positions_AT.shape
    positions_AT[1] = positions_AT[1, 0] + torch.arange(T, device=device)  # no padding
    column_major = positions_AT.t().contiguous().t()
    live_AT = torch.ones(A, 1, dtype=torch.bool, device=device).expand(A, T)
    with torch.no_grad():
        got = decode_attention(q, k, v, rows_A, column_major, live_AT, limit)
        want = reference(q, k, v, rows_A, positions_AT, limit)
    assert (got.float() - want.float()).abs().max().item() <= TOL[q.dtype]


def check_heads_kernel(device: str, case: tuple, hb: int, bn: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]  # noqa: E501
    """T = 1 and H = G through the several-heads kernel (`attention.HEADS` with HB heads and BN
    key columns a block): against SDPA, and independent of the key bucket."""
    from birkhoff.kernels import attention

    monkeypatch.setattr(attention, "HEADS", dict(attention.HEADS, HB=hb, BN=bn, PAIRS=0))
    check_decode_attention(device, case)
    check_limit_independent(device, case)


def check_attention_rope(device: str, case: tuple) -> None:
    """A chunk of decode size: `decode_attention_rope` on the raw projections against
    `rope_cache` then `decode_attention`: the same caches, bit for bit, except the trash slot
    that a padded token writes only through rope_cache; the same output bits through the
    per-head kernel, and within the SDPA tolerance through the several-heads kernel (T = 1,
    which takes the new key from registers, first, so it sums in another order)."""
    from birkhoff.kernels.attention import decode_attention, decode_attention_rope, heads_kernel
    from birkhoff.kernels.norm_rope import rope_cache

    dt, T, H, G, K, B, N, limit = case
    q, k, v, rows_A, positions_AT, valid_AT, limit = make_case(device, case)
    g = torch.Generator().manual_seed(1)
    A = q.shape[0]
    # the new tokens' projections as views of one fused qkv row, as the engine passes them
    qkv = torch.randn(A, T, (H + 2 * G) * K, generator=g).to(dt).to(device)
    q_new, k_new, v_new = qkv.split([H * K, G * K, G * K], -1)
    q_new, k_new, v_new = q_new.view(A, T, H, K), k_new.view(A, T, G, K), v_new.view(A, T, G, K)
    theta = 100 * torch.rand(A, T, K // 2, generator=g, dtype=torch.float64)
    cos, sin = theta.cos().to(device), theta.sin().to(device)
    if A > 1 and T == 1:  # a padded row (a CUDA graph's bucket): its token points at the trash
        valid_AT[1], positions_AT[1] = False, N - 1
    k_ref, v_ref = k.clone(), v.clone()
    with torch.no_grad():
        q_rot = rope_cache(q_new, k_new, v_new, cos, sin, k_ref, v_ref, rows_A, positions_AT)
        want = decode_attention(q_rot, k_ref, v_ref, rows_A, positions_AT, valid_AT, limit)
        got = decode_attention_rope(
            q_new, k_new, v_new, cos, sin, k, v, rows_A, positions_AT, valid_AT, limit
        )
    real = valid_AT
    if heads_kernel(q.shape[0], T, H, G):
        ref = reference(q_rot, k_ref, v_ref, rows_A, positions_AT, limit)
        for other in (want, ref):
            assert (got[real].float() - other[real].float()).abs().max().item() <= TOL[dt]
    else:
        assert torch.equal(got[real], want[real])
    assert torch.equal(k[..., : N - 1, :], k_ref[..., : N - 1, :])
    assert torch.equal(v[..., : N - 1, :], v_ref[..., : N - 1, :])
