"""The seed's crash on the GPU: reclaim="always" on the mHC + MTP model reads freed memory.

Each case runs benchmarks/recompute_memory.py's sanitizer case in a child process (a read of
freed device memory poisons the CUDA context): "always" fails, under birkhoff's sanitizer with a
UseAfterFreeError naming the output contraction's node and MTP's checkpoint, without it with the
read itself (the fused kernels read the freed pointer: an illegal memory access; eager autograd's
storage bounds check stops the read first). "safe" completes with the losses and gradients of
"never". Dense and MoE models, fused and eager mHC kernels. Skipped without CUDA.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "recompute_memory.py"
MODELS = [[], ["--moe"]]


def sanitizer_case(*flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(BENCH), "--device", "cuda", "--sanitizer-case", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=BENCH.parent)


@pytest.mark.parametrize("model", MODELS, ids=["dense", "moe"])
@pytest.mark.parametrize("kernels", ["auto", "eager"])
def test_always_is_named_by_the_sanitizer(kernels: str, model: list[str]) -> None:
    proc = sanitizer_case("always", "--check", "--kernels", kernels, *model)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "UseAfterFreeError" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "'contraction'" in proc.stdout and "checkpoint 'mtp.0' freed" in proc.stdout


@pytest.mark.parametrize("kernels", ["auto", "eager"])
def test_always_reads_the_freed_storage(kernels: str) -> None:
    proc = sanitizer_case("always", "--kernels", kernels)
    assert proc.returncode != 0, proc.stdout + proc.stderr[-3000:]
    expected = (
        "illegal memory access" if kernels == "auto" else "out of bounds for storage of size 0"
    )
    assert expected in proc.stdout + proc.stderr, proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("model", MODELS, ids=["dense", "moe"])
@pytest.mark.parametrize("kernels", ["auto", "eager"])
def test_safe_equals_never(kernels: str, model: list[str]) -> None:
    proc = sanitizer_case("safe", "--check", "--kernels", kernels, *model)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "identical to reclaim='never': True" in proc.stdout
