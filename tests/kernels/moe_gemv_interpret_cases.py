"""The fused MoE decode ops against the eager MoE functions under the Triton interpreter on CPU
(run by test_mhc_interpret.py in a fresh process)."""

from __future__ import annotations

import os

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

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_route_picks_the_eager_experts(case: tuple) -> None:
    check_moe_route("cpu", case, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_experts_match_eager(case: tuple, dtype: torch.dtype) -> None:
    check_moe_experts("cpu", case, dtype)


@pytest.mark.parametrize("case", MOE_CASES[:2])
def test_moe_experts_fp8_match_dequantized(case: tuple) -> None:
    check_moe_experts_fp8("cpu", case, torch.bfloat16)


def test_moe_rejects_bad_inputs() -> None:
    check_moe_rejects("cpu")


def test_moe_engine_greedy_tokens_fused_equal_eager() -> None:
    check_moe_engine_tokens("cpu", num_new=3, num_layers=1)  # one layer, an MoE one
