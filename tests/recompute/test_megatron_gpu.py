"""megatron-core's GPT + MTP under full recompute, stock backward vs birkhoff's patch (CUDA).

Runs benchmarks/recompute_megatron.py's quick size: the same loss and gradients as megatron's
own backward, and with an MoE-style stash in every decoder MLP less memory left after the step
(megatron's backward leaves each stashed layer's recompute input and its .grad reachable).
Skipped without CUDA or without megatron-core (Python >= 3.12; carried as a wheel).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("megatron.core")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "recompute_megatron.py"


def load_bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("recompute_megatron", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["recompute_megatron"] = module
    spec.loader.exec_module(module)
    return module


def test_patch_matches_megatron_and_recovers_the_stash_leak() -> None:
    bench = load_bench()
    args = bench.parse_args(["--quick", "--stash"])
    size = bench.SIZES["quick"]
    bench.init_parallel("cuda")
    rows = {v: bench.run_variant(v, args, size) for v in ("megatron", "safe")}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    ref, got = rows["megatron"], rows["safe"]
    assert abs(got["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert got["after_step_bytes"] < ref["after_step_bytes"]
    assert got["peak_bytes"] <= ref["peak_bytes"]
