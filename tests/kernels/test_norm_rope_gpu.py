"""Fused RMSNorm, rope and the one-row matmul on CUDA against the eager functions (the engine
greedy check with every fused op is test_mhc_gpu.py's)."""

from __future__ import annotations

import pytest
import torch
from gemv_cases import DTYPES, FP8_CASES, GEMV_CASES, check_gemv, check_gemv_fp8, check_gemv_rejects
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


DECODE_SHAPES = [((1, 1), 2304, 768, True), ((1,), 768, 2048, False)]  # h200-small's


@pytest.mark.parametrize("case", GEMV_CASES + DECODE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_matches_linear(case: tuple, dtype: torch.dtype) -> None:
    check_gemv("cuda", case, dtype)


def test_gemv_rejects_more_rows_and_strided_rows() -> None:
    check_gemv_rejects("cuda")


@pytest.mark.parametrize("case", FP8_CASES + DECODE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_block_fp8_matches_the_dequantized_weight(case: tuple, dtype: torch.dtype) -> None:
    check_gemv_fp8("cuda", case, dtype)


def test_gemv_custom_op_registration() -> None:
    from birkhoff.kernels.gemv import gemv

    args = (torch.randn(1, 40, device="cuda"), torch.randn(24, 40, device="cuda"), None)
    torch.library.opcheck(gemv, args)
