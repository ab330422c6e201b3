"""Checks of the fused few-row matmul `kernels.gemv` against F.linear, shared by the
interpreter (CPU) and the CUDA tests.

Tolerances: fp32 within 2e-5 of max(1, |y|) (fp32 sums in another order); bf16 / fp16 within
2^-6 of max(1, |y|) (both round an fp32 sum once: one ulp apart where the sums straddle a
rounding boundary).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from birkhoff.kernels.gemv import gemv

# (leading shape of x, N, K, bias): one K tile and several, N not a multiple of BN, K odd;
# one row, 2-4 (a row count that is no power of two among them) with N <= K and N > K (a
# verify chunk's qkv and gate_up), 5-8 (draft depths of J = 4)
GEMV_CASES = [((1,), 24, 40, False), ((1, 1), 7, 300, True), ((1, 1, 1), 21, 64, True),
              ((1, 1), 5, 3001, False), ((1,), 1, 1, True), ((2,), 9, 700, True),
              ((1, 3), 33, 1030, False), ((2, 2), 96, 700, True),
              ((1, 4, 1), 3, 5, True), ((1, 3), 300, 96, True), ((2,), 70, 33, False),
              ((5,), 45, 600, True), ((2, 4), 200, 70, False)]  # fmt: skip
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# block-fp8 W: GEMV_CASES' edge shapes and square block grids (3 x 3, 2 x 2)
FP8_CASES = [
    *GEMV_CASES[:4],
    ((2,), 300, 260, False),
    ((4,), 256, 256, True),
    ((3,), 384, 130, True),
    ((7,), 130, 256, False),
]


def rel_err(y: torch.Tensor, want: torch.Tensor) -> float:
    """max |y - want| / max(1, |want|), y rounded as returned."""
    return ((y.float() - want).abs() / want.abs().clamp(min=1)).max().item()


def check_gemv(device: str, case: tuple, dtype: torch.dtype) -> None:
    lead, N, K, with_bias = case
    g = torch.Generator().manual_seed(N * K)
    x = torch.randn(*lead, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if with_bias else None
    y = gemv(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert y.shape == (*lead, N) and y.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2.0**-6
    err = rel_err(y, want)
    assert err <= tol, (err, tol)
    if K > 1:  # a column slice of W: its rows are strided, each row still contiguous
        half, cut = x[..., : K // 2], w[:, : K // 2]
        got, ref = gemv(half, cut, b).float(), F.linear(half.float(), cut.float())
        if b is not None:
            ref = ref + b.float()
        assert rel_err(got, ref) <= tol


def check_gemv_fp8(device: str, case: tuple, dtype: torch.dtype) -> None:
    """Block-fp8 W (codes and 128 x 128 block scales, as the engine's quantize="fp8" stores it)
    against F.linear of the same W dequantized in fp32: the kernel decodes the codes exactly as
    the dequantization does, so only the sum's order differs (the bf16 tolerance of
    check_gemv for bf16 / fp16 x)."""
    from birkhoff.engine.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise

    lead, N, K, with_bias = case
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(*lead, K, generator=g).to(device, dtype)
    q, s = quantize_fp8_blockwise(torch.randn(N, K, generator=g) / K**0.5)
    q, s = q.to(device), s.to(device)
    b = torch.randn(N, generator=g).to(device, dtype) if with_bias else None
    y = gemv(x, q, b, s)
    w = dequantize_fp8_blockwise(q, s, block=128, dtype=torch.float32)
    want = F.linear(x.float(), w, None if b is None else b.float())
    assert y.shape == (*lead, N) and y.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2.0**-6
    err = rel_err(y, want)
    assert err <= tol, (err, tol)
    # a wrong block's scale (the scales transposed where the grid is square) must show
    if s.shape[0] == s.shape[1] > 1 and not torch.equal(s, s.t()):
        bad = gemv(x, q, b, s.t().contiguous())
        assert rel_err(bad, want) > tol


def check_gemv_rejects(device: str) -> None:
    w = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="not 1 to 8 rows of 8 features"):
        gemv(torch.randn(9, 8, device=device), w, None)
    with pytest.raises(ValueError, match="not 1 to 8 rows of 8 features"):
        gemv(torch.randn(0, 8, device=device), w, None)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        gemv(torch.randn(1, 4, device=device), w.t(), None)
    q = w.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale_inv missing"):
        gemv(torch.randn(1, 8, device=device), q, None)
    with pytest.raises(ValueError, match="scale_inv given"):
        gemv(torch.randn(1, 8, device=device), w, None, torch.ones(1, 1, device=device))
    with pytest.raises(ValueError, match=r"expected \(1, 1\) float32"):
        gemv(torch.randn(1, 8, device=device), q, None, torch.ones(2, 1, device=device))
