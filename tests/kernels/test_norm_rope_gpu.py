"""Fused RMSNorm and rope on CUDA against the eager functions (the engine greedy check with every
fused op is test_mhc_gpu.py's)."""

from __future__ import annotations

import pytest
import torch
from norm_rope_cases import (
    NORM_CASES,
    ROPE_CASES,
    SILU_CASES,
    check_rms_norm,
    check_rope,
    check_rope_cache,
    check_silu_mul,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(("dtype", "D", "with_weight"), NORM_CASES)
def test_rms_norm_matches_eager(dtype: torch.dtype, D: int, with_weight: bool) -> None:
    check_rms_norm("cuda", dtype, D, with_weight)


@pytest.mark.parametrize(("dtype", "H", "G", "K"), ROPE_CASES)
def test_rope_matches_eager(dtype: torch.dtype, H: int, G: int, K: int) -> None:
    check_rope("cuda", dtype, H, G, K)


@pytest.mark.parametrize(("dtype", "H", "G", "K"), ROPE_CASES)
def test_rope_cache_matches_rope_and_cache_write(
    dtype: torch.dtype, H: int, G: int, K: int
) -> None:
    check_rope_cache("cuda", dtype, H, G, K)


@pytest.mark.parametrize(("dtype", "F"), SILU_CASES)
def test_silu_mul_matches_swiglu(dtype: torch.dtype, F: int) -> None:
    check_silu_mul("cuda", dtype, F)
