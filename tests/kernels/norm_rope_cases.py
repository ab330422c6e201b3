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
