"""The GEMM-folded mHC ops on CUDA: the op checks of mhc_fold_cases.py at a tensor-core size
(bf16 on tensor cores, fp32 as exact dots), and a bf16-autocast model step folded vs unfolded."""

from __future__ import annotations

import pytest
import torch
from mhc_fold_cases import (
    check_folded_safe_reclaim,
    check_folded_train_step,
    check_mix_norm_linear,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 200, 4, 256, 384), (1, 7, 4, 72, 40)], ids=str)
def test_folded_ops_match_the_unfused_path(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check_mix_norm_linear(*shape, dtype, device="cuda")


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_folded_model_step(autocast: bool) -> None:
    tol = (1e-2, 5e-2) if autocast else (1e-6, 1e-4)
    check_folded_train_step("cuda", autocast=autocast, loss_tol=tol[0], grad_tol=tol[1])


def test_folded_model_under_safe_reclaim() -> None:
    check_folded_safe_reclaim("cuda")
