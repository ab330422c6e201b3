"""Runs the interpreter cases (mHC ops; RMSNorm and rope; random numbers, sampling and a step's
chunk and verify tail; decode attention) in a fresh process with TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when a kernel is defined (at import of birkhoff.kernels), so the
interpreter cases cannot share this process, where other tests may already have imported it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.parametrize(
    "cases",
    [
        "mhc_interpret_cases.py",
        "mhc_fold_interpret_cases.py",
        "norm_rope_interpret_cases.py",
        "rng_interpret_cases.py",
        "attention_interpret_cases.py",
        "moe_gemv_interpret_cases.py",
    ],
)
def test_fused_ops_under_the_triton_interpreter(cases: str) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE.parents[1] / "src"))
    cases = str(HERE / cases)
    opts = [
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-W",
        "ignore::DeprecationWarning",
    ]
    cmd = [sys.executable, "-m", "pytest", cases, *opts]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=HERE.parents[1])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
