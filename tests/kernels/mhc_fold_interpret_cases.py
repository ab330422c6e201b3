"""The GEMM-folded mHC ops under the Triton interpreter on CPU (run by test_mhc_interpret.py with
TRITON_INTERPRET=1 in a fresh process): forward and every gradient against the unfused path."""

from __future__ import annotations

import os

import pytest
import torch
from mhc_fold_cases import (
    check_folded_safe_reclaim,
    check_folded_train_step,
    check_mix_norm_linear,
)

from birkhoff.kernels.mhc.configs import CONFIG

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(2, 9, 4, 48, 40), (1, 1, 4, 16, 16), (1, 5, 3, 20, 24)]  # B, T, S, D, O


def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small row passes: backward programs that loop over several row blocks, the last one
    partly past N."""
    monkeypatch.setitem(CONFIG, "fold_norm", dict(ELEMENTS=256, PROGRAMS=2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_mix_norm_linear_matches_the_unfused_path(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    check_mix_norm_linear(*shape, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_folded_ops_over_several_tiles(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    small_tiles(monkeypatch)
    check_mix_norm_linear(2, 9, 4, 40, 36, dtype)


def test_folded_model_train_step_matches_the_unfused_ops() -> None:
    check_folded_train_step("cpu", autocast=False, loss_tol=1e-6, grad_tol=1e-4)


def test_folded_model_under_recompute_with_safe_reclaim() -> None:
    check_folded_safe_reclaim("cpu")
