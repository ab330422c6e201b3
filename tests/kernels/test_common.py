"""kernels/common.py: the package imports without Triton (a stand-in), and the shared checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from birkhoff.kernels.common import cdiv, check_inputs, pow2, use_fused

WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError
import torch
import birkhoff.kernels as k
import birkhoff.model, birkhoff.engine
assert not k.TRITON and not k.use_fused(torch.zeros(1), "auto")
assert callable(k.mhc.coefficients.coeff_tail)  # the kernel stays a plain function
print("ok")
"""


def test_the_package_imports_without_triton() -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=src)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_sizes_and_checks() -> None:
    assert [pow2(n) for n in (1, 2, 3, 17)] == [1, 2, 4, 32]
    assert cdiv(7, 2) == 4 and cdiv(8, 2) == 4
    with pytest.raises(ValueError, match="float64"):
        check_inputs(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="kernels='fast' is invalid"):
        use_fused(torch.zeros(1), "fast")
    assert not use_fused(torch.zeros(1), "auto") and not use_fused(torch.zeros(1), "eager")
