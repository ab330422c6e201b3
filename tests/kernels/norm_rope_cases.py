"""Checks of the fused RMSNorm and rope (birkhoff.kernels.norm_rope) against the eager
functions, on any device: CPU under the Triton interpreter (norm_rope_interpret_cases.py) and
CUDA (test_norm_rope_gpu.py)."""

from __future__ import annotations

import torch

from birkhoff.model.layers import apply_rope, rms_norm, rope_tables

TOL = {torch.float32: 2e-6, torch.bfloat16: 2**-7}  # relative: fp32 rounding / one bf16 ulp
NORM_CASES = [(dt, D, w) for dt in (torch.float32, torch.bfloat16) for D in (16, 40, 768)
              for w in (True, False)]  # fmt: skip
ROPE_CASES = [(dt, *hgk) for dt in (torch.float32, torch.bfloat16)
              for hgk in ((4, 2, 16), (3, 3, 8), (12, 12, 64))]  # fmt: skip


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[want.dtype] * max(1.0, want.float().abs().max().item()), err


def check_rms_norm(device: str, dtype: torch.dtype, D: int, with_weight: bool) -> None:
    g = torch.Generator().manual_seed(D)
    wide = 3.0 * torch.randn(3, 17, D + 8, generator=g).to(dtype)
    x = wide.to(device)[..., 4 : 4 + D]  # a strided view: rows D + 8 apart
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(device) if with_weight else None
    with torch.no_grad():
        close(rms_norm(x, w, 1e-6, kernels="triton"), rms_norm(x, w, 1e-6))


def check_rope(device: str, dtype: torch.dtype, H: int, G: int, K: int) -> None:
    """q and k as the engine has them: views of the fused qkv projection."""
    g = torch.Generator().manual_seed(K)
    A, T = 3, 5
    qkv = torch.randn(A, T, (H + 2 * G) * K, generator=g).to(dtype).to(device)
    q, k, _ = qkv.split([H * K, G * K, G * K], -1)
    positions = torch.randint(0, 100, (A, T), generator=g).to(device)
    cos, sin = rope_tables(positions, K, 10000.0)  # fp64, as the engine's tables
    with torch.no_grad():
        for x in (q.view(A, T, H, K), k.view(A, T, G, K)):
            close(apply_rope(x, cos, sin, kernels="triton"), apply_rope(x, cos, sin))


def check_rope_cache(device: str, dtype: torch.dtype, H: int, G: int, K: int) -> None:
    """rope(q) returned, rope(k) and v written at (row, position) of one cache layer, as the
    eager rope and KVCache.write do; a padded token writes the trash slot only."""
    from birkhoff.engine.kv_cache import KVCache
    from birkhoff.kernels.norm_rope import rope_cache

    g = torch.Generator().manual_seed(K + H)
    A, T, B, N = 3, 4, 5, 32
    qkv = torch.randn(A, T, (H + 2 * G) * K, generator=g).to(dtype).to(device)
    q, k, v = (t.view(A, T, -1, K) for t in qkv.split([H * K, G * K, G * K], -1))
    rows = torch.tensor([3, 0, 4], device=device)
    positions = (torch.tensor([[5], [0], [20]]) + torch.arange(T)).to(device)
    positions[2, -1] = N - 1  # padding: the trash slot
    cos, sin = rope_tables(positions, K, 10000.0)
    before = torch.randn(2, 2, B, G, N, K, generator=g).to(dtype).to(device)
    caches = [KVCache(2, B, G, N, K, dtype=dtype, device=device) for _ in range(2)]
    for c in caches:
        c.k.copy_(before[0]), c.v.copy_(before[1])
    with torch.no_grad():
        got_q = rope_cache(q, k, v, cos, sin, *caches[0].layer(1), rows, positions)
        want_q = apply_rope(q, cos, sin)
        caches[1].write(1, rows, positions, apply_rope(k, cos, sin), v)
    close(got_q, want_q)
    for got, want in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        close(got[:, :, :, : N - 1], want[:, :, :, : N - 1])


SILU_CASES = [(dt, F) for dt in (torch.float32, torch.bfloat16) for F in (24, 2048, 3000)]


def check_silu_mul(device: str, dtype: torch.dtype, F: int) -> None:
    from birkhoff.model.layers import swiglu, swiglu_halves

    g = torch.Generator().manual_seed(F)
    gate_up = (2 * torch.randn(2, 7, 2 * F, generator=g)).to(dtype).to(device)
    with torch.no_grad():
        got = swiglu_halves(gate_up, kernels="triton")
        want = swiglu(*gate_up.float().chunk(2, dim=-1)).to(dtype)  # fp32 math, one rounding
    close(got, want)
    close(swiglu_halves(gate_up), swiglu(*gate_up.chunk(2, dim=-1)))
