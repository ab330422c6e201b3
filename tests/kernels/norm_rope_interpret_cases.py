"""Fused RMSNorm, rope and the one-row matmul against the eager functions under the Triton
interpreter on CPU (run by test_mhc_interpret.py in a fresh process)."""

from __future__ import annotations

import os

import pytest
import torch
from gemv_cases import DTYPES, FP8_CASES, GEMV_CASES, check_gemv, check_gemv_fp8, check_gemv_rejects
from mhc_model_cases import check_engine_tokens
from norm_rope_cases import (
    NORM_CASES,
    ROPE_CASES,
    SILU_CASES,
    check_rms_norm,
    check_rope,
    check_rope_cache,
    check_silu_mul,
)

from birkhoff.model.layers import rms_norm

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


@pytest.mark.parametrize(("dtype", "D", "with_weight"), NORM_CASES)
def test_rms_norm_matches_eager(dtype: torch.dtype, D: int, with_weight: bool) -> None:
    check_rms_norm("cpu", dtype, D, with_weight)


@pytest.mark.parametrize(("dtype", "H", "G", "K"), ROPE_CASES)
def test_rope_matches_eager_on_views_of_the_qkv_projection(
    dtype: torch.dtype, H: int, G: int, K: int
) -> None:
    check_rope("cpu", dtype, H, G, K)


def test_fused_ops_serve_inference_only() -> None:
    """With a gradient needed the eager functions run (their autograd stays the reference)."""
    x = torch.randn(2, 3, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    y = rms_norm(x, w, 1e-6, kernels="triton")
    assert y.grad_fn is not None and "birkhoff" not in type(y.grad_fn).__name__.lower()
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, w, 1e-6, kernels="triton"), y.detach())
    with pytest.raises(ValueError, match="kernels='bogus'"):
        rms_norm(x, w, 1e-6, kernels="bogus")


@pytest.mark.parametrize("name", ["rms_norm", "rope"])
def test_custom_op_registration(name: str) -> None:
    from birkhoff.kernels import norm_rope

    x = torch.randn(2, 3, 4, 8)
    cos, sin = torch.rand(2, 3, 4, dtype=torch.float64), torch.rand(2, 3, 4, dtype=torch.float64)
    args = (x, torch.ones(8), 1e-6) if name == "rms_norm" else (x, cos, sin)
    torch.library.opcheck(getattr(norm_rope, name), args)


def test_engine_greedy_tokens_fused_equal_eager() -> None:
    # a prefill token, then verify steps of 2 drafts; one layer (every layer runs the same ops;
    # the exit projecting for the next entry: mhc_interpret_cases.py, exit cases)
    check_engine_tokens("cpu", num_new=4, num_layers=1)


@pytest.mark.parametrize(("dtype", "H", "G", "K"), ROPE_CASES)
def test_rope_cache_matches_rope_and_cache_write(
    dtype: torch.dtype, H: int, G: int, K: int
) -> None:
    check_rope_cache("cpu", dtype, H, G, K)


@pytest.mark.parametrize(("dtype", "F"), SILU_CASES)
def test_silu_mul_matches_swiglu(dtype: torch.dtype, F: int) -> None:
    check_silu_mul("cpu", dtype, F)


def test_engine_steps_run_the_fused_per_token_ops() -> None:
    """With fused kernels the engine's prefill, decode and speculative steps call the fused
    attention prologue, decode attention, SwiGLU and mHC entry, and the few-row matmul exactly
    where `gemv.serves` says (no silent fallback to the eager ops)."""
    from collections import Counter

    from mhc_model_cases import build_model, tiny_config
    from torch.utils._python_dispatch import TorchDispatchMode

    from birkhoff.engine import Engine, SamplingParams
    from birkhoff.kernels.gemv import serves

    class Calls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: Counter[str] = Counter()
            self.gemv_shapes: set[tuple[int, int, int]] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = str(func).split(".")[1] if str(func).startswith("birkhoff") else ""
            self.seen[name] += 1
            part = args[8] if len(args) > 8 else (kwargs or {}).get("part")
            if name == "mhc_entry" and part is not None:
                self.seen["mhc_entry from mhc_exit"] += 1
            if name == "gemv":
                x, w = args[0], args[1]
                self.gemv_shapes.add((x.numel() // w.shape[1], *w.shape))
            return func(*args, **(kwargs or {}))

    model = build_model(tiny_config(mtp_depth=1), "cpu", "triton")
    engine = Engine.from_model(model, device="cpu", dtype=torch.float32, kernels="triton")
    D = model.cfg.dim
    with Calls() as calls:  # two rows, verify and draft chunks of 2-3 positions; then one row
        engine.generate([[1, 2, 3], [4, 5]], SamplingParams(3, num_speculative_tokens=1))
        engine.generate([[6, 7]], SamplingParams(3))
    assert calls.gemv_shapes and all(serves(*shape) for shape in calls.gemv_shapes)
    assert {(rows, N) for rows, N, _ in calls.gemv_shapes} >= {(2, D), (4, D)}  # wo and down
    assert any(rows > 1 and N == 3 * D for rows, N, _ in calls.gemv_shapes)  # a verify qkv
    # (the sublayer norms run inside mhc_entry: S = 4, no q/k norm, so no rms_norm launch)
    # (chunks of decode size, short prompts too, attend with their prologue folded in)
    ops = ("decode_attention_rope", "silu_mul", "mhc_entry", "mhc_entry_rest", "mhc_exit",
           "sample_next", "chunk_inputs", "verify_accept")  # fmt: skip
    for op in ops:
        assert calls.seen[op] > 0, (op, calls.seen)
    # every mix out but the MTP merge's input projects for the entry after it, which reads that
    assert calls.seen["mhc_entry from mhc_exit"] == calls.seen["mhc_exit"], calls.seen
    assert calls.seen["mhc_exit"] == calls.seen["mhc_entry_rest"], calls.seen
    assert (1, 3 * D, D) in calls.gemv_shapes  # a batch-1 decode step's fused qkv
    # the prologue replaced the separate rope, cache-write and attention launches
    assert calls.seen["rope"] == calls.seen["rope_cache"] == calls.seen["decode_attention"] == 0


@pytest.mark.parametrize("case", GEMV_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_matches_linear(case: tuple, dtype: torch.dtype) -> None:
    check_gemv("cpu", case, dtype)


def test_gemv_rejects_more_rows_and_strided_rows() -> None:
    check_gemv_rejects("cpu")


# every x dtype on the edge shapes; the block grids (hundreds of programs here) in bf16 only
FP8_PARAMS = [(case, dtype) for case in FP8_CASES[:4] for dtype in DTYPES]
FP8_PARAMS += [(case, torch.bfloat16) for case in FP8_CASES[4:]]


@pytest.mark.parametrize(("case", "dtype"), FP8_PARAMS, ids=str)
def test_gemv_block_fp8_matches_the_dequantized_weight(case: tuple, dtype: torch.dtype) -> None:
    check_gemv_fp8("cpu", case, dtype)


def test_gemv_serves_few_rows_of_small_weights_only() -> None:
    from birkhoff.kernels.gemv import FEW_ROWS_WEIGHTS, serves

    assert serves(1, 14336, 4096) and serves(4, 768, 2048) and serves(2, 768, 768)
    assert serves(3, 2304, 768) and serves(8, 4096, 768)  # N > K; up to MAX_ROWS rows
    assert not serves(9, 768, 2048)  # over MAX_ROWS rows
    assert not serves(4, 4096, 4096) and FEW_ROWS_WEIGHTS < 4096 * 4096


def test_fp8_engine_decodes_through_the_fp8_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block-fp8 engine's one-row steps read the e4m3 codes in `gemv` (no dequantized copy of
    W) and give the tokens and log-probs of the same engine on its dequantizing path."""
    from mhc_model_cases import build_model, tiny_config

    from birkhoff.engine import Engine, SamplingParams
    from birkhoff.kernels import fp8_matmul
    from birkhoff.kernels import gemv as gemv_module

    # one layer and a 128-wide MLP: fewer gemv programs a step
    model = build_model(
        tiny_config(mtp_depth=0, dim=128, num_layers=1, mlp_hidden=128), "cpu", "triton"
    )
    engine = Engine.from_model(
        model, device="cpu", dtype=torch.float32, quantize="fp8", kernels="triton"
    )
    scaled = []
    real = gemv_module.gemv

    def spy(x, w, b, scale_inv=None, block=128):  # type: ignore[no-untyped-def]
        scaled.append(scale_inv is not None and w.dtype == torch.float8_e4m3fn)
        return real(x, w, b, scale_inv, block)

    monkeypatch.setattr(gemv_module, "gemv", spy)
    # the other matmuls dequantize in both runs (the fp8 GEMM would round the activation to e4m3)
    monkeypatch.setattr(fp8_matmul, "supported", lambda x: False)
    params = SamplingParams(3)
    out = engine.generate([[1, 2, 3]], params)
    assert scaled and all(scaled)
    monkeypatch.setattr(gemv_module, "serves", lambda *shape: False)  # dequantize, then matmul
    ref = engine.generate([[1, 2, 3]], params)
    assert out[0].tokens == ref[0].tokens
    assert max(abs(a - b) for a, b in zip(out[0].logprobs, ref[0].logprobs, strict=True)) < 1e-4


def test_a_fused_plain_step_launches_only_the_layers_chunk_embedding_and_sampling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every op a fused plain decode step dispatches (counted as benchmarks/step_ops.py counts
    them) is a fused op, a matmul or the embedding's gather: no eager glue (wheres, casts,
    index writes, stacks) is left around the layers."""
    from collections import Counter, defaultdict
    from pathlib import Path

    from mhc_model_cases import build_model, tiny_config

    from birkhoff.engine import Engine, SamplingParams
    from birkhoff.engine import decode as decode_module

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from step_ops import counted

    steps: defaultdict[str, list[Counter[str]]] = defaultdict(list)
    monkeypatch.setattr(decode_module, "plain_step",
                        counted(decode_module.plain_step, "plain", steps))  # fmt: skip
    # one layer: every layer dispatches the same ops
    model = build_model(tiny_config(mtp_depth=1, num_layers=1), "cpu", "triton")
    engine = Engine.from_model(model, device="cpu", dtype=torch.float32, kernels="triton")
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(3))
    ops = sum(steps["plain"], Counter())
    fused = sum(n for name, n in ops.items() if name.startswith("birkhoff."))
    assert len(steps["plain"]) == 2 and fused > 0 and ops["aten.index.Tensor"] == 2, ops
    unfused = {name for name in ops if not name.startswith("birkhoff.")}
    assert unfused <= {"aten.linear", "aten.index.Tensor"}, ops


def test_a_fused_draft_depth_launches_its_block_and_a_few_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fused speculative step of J drafts dispatches a plain step's ops, plus per draft depth
    its block, its model ops outside the block (the merge's projection, contraction + norm,
    lm_head, the sampling site) and at most 3 indexing ops (the depth's inputs in one op, the
    write of its streams for the next depth, the gather of its last position), plus at most 3
    for the whole step (the verify pass's stream write, the stacks of drafts and q)."""
    from collections import Counter, defaultdict
    from pathlib import Path

    from mhc_model_cases import build_model, tiny_config

    from birkhoff.engine import Engine, SamplingParams
    from birkhoff.engine import decode as decode_module
    from birkhoff.engine import forward as forward_module

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from step_ops import counted

    steps: defaultdict[str, list[Counter[str]]] = defaultdict(list)
    for kind in ("plain_step", "speculative_step"):
        monkeypatch.setattr(decode_module, kind, counted(getattr(decode_module, kind), kind, steps))
    monkeypatch.setattr(forward_module, "block", counted(forward_module.block, "block", steps))
    # one layer: the layers' ops are in both the plain and the speculative step
    model = build_model(tiny_config(mtp_depth=1, num_layers=1), "cpu", "triton")
    engine = Engine.from_model(model, device="cpu", dtype=torch.float32, kernels="triton")
    J = 2
    engine.generate([[1, 2, 3]], SamplingParams(2))
    steps.clear()
    engine.generate([[1, 2, 3]], SamplingParams(2 + J, num_speculative_tokens=J))
    engine.generate([[1, 2, 3]], SamplingParams(3))
    plain, spec = (sum(steps[kind][-1].values()) for kind in ("plain_step", "speculative_step"))
    block = max(sum(ops.values()) for ops in steps["block"])  # an MTP block's first entry too
    overhead = spec - plain - J * block
    assert overhead <= J * (4 + 3) + 3, (plain, spec, block, steps["speculative_step"][-1])
