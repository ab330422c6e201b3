"""The fused MoE decode ops on CUDA against the eager MoE functions."""

from __future__ import annotations

import pytest
import torch
from moe_gemv_cases import (
    DTYPES,
    MOE_CASES,
    check_moe_engine_tokens,
    check_moe_experts,
    check_moe_experts_fp8,
    check_moe_rejects,
    check_moe_route,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_route_picks_the_eager_experts(case: tuple) -> None:
    check_moe_route("cuda", case, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_experts_match_eager(case: tuple, dtype: torch.dtype) -> None:
    check_moe_experts("cuda", case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_experts_fp8_match_dequantized(case: tuple, dtype: torch.dtype) -> None:
    check_moe_experts_fp8("cuda", case, dtype)


def test_moe_rejects_bad_inputs() -> None:
    check_moe_rejects("cuda")


def test_moe_engine_greedy_tokens_fused_equal_eager() -> None:
    check_moe_engine_tokens("cuda")
