"""Block-fp8 matmuls: the Triton kernel's two modes (fp8 x fp8, weight-only) against their fp32
references and the dequantizing CPU path (Triton interpreter on CPU, the compiled kernel on a
Hopper GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from birkhoff.config import ModelConfig
from birkhoff.engine import Engine, SamplingParams
from birkhoff.engine.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise
from birkhoff.kernels import fp8_matmul
from birkhoff.kernels.fp8_matmul import (
    fp8_linear,
    fp8_linear_reference,
    quantize_activation,
    quantize_activation_cuda,
)
from birkhoff.model import Transformer

SHAPES = [(3, 200, 130), (20, 256, 64), (1, 96, 40), (70, 384, 256)]  # N rows, X in, Y out


def tiny_config(**overrides: object) -> ModelConfig:
    """tests/engine's tiny engine config (engine_helpers.tiny_config)."""
    base: dict[str, object] = dict(
        vocab_size=16,
        dim=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        num_streams=2,
        mtp_depth=2,
        max_seq_len=48,
    )
    base.update(overrides)
    return ModelConfig(**base)  # type: ignore[arg-type]


def check_kernel(device: str, dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> None:
    """fp8 x fp8: fp8_linear == the fp32 reference of its formula (to accumulation order), and
    within the activation's e4m3 rounding of the dequantizing path. Weight-only: the dequantizing
    path's fp32 product, to accumulation order and y's rounding."""
    gen = torch.Generator().manual_seed(0)
    for N, X, Y in shapes:
        x = torch.randn(N, X, generator=gen).to(device, dtype)
        q, scale_inv = quantize_fp8_blockwise((0.1 * torch.randn(Y, X, generator=gen)).to(device))
        y = fp8_linear(x, q, scale_inv, quantize_input=True)
        assert y.shape == (N, Y) and y.dtype == dtype
        ref = fp8_linear_reference(x.float(), q, scale_inv)
        # fp32: Hopper's fp8 tensor cores accumulate with fewer mantissa bits than fp32 (measured
        # on an H200: 2e-4 of max|ref| at 384-768 inputs, 2e-7 below 256); bf16 output: 3e-3.
        tol = 1e-3 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        dense = x.float() @ dequantize_fp8_blockwise(q, scale_inv).t()
        assert (y.float() - dense).abs().max() <= 0.1 * dense.abs().max()
        assert not torch.equal(y.float(), dense)  # the activation really went through e4m3
        wo = fp8_linear(x, q, scale_inv, quantize_input=False)
        assert wo.shape == (N, Y) and wo.dtype == dtype
        ref_wo = fp8_linear_reference(x.float(), q, scale_inv, quantize_input=False)
        assert torch.equal(ref_wo, dense)  # the weight-only formula is the dequantized product
        # fp32 sums of exact products in another order; a bf16 y is rounded once (2^-8)
        tol = 1e-5 if dtype == torch.float32 else 2.0**-8
        torch.testing.assert_close(wo.float(), dense, rtol=tol, atol=tol * dense.abs().max().item())
        assert (wo.float() - dense).abs().max() < 0.25 * (y.float() - dense).abs().max()


def check_mode_rule(device: str) -> None:
    """Up to WEIGHT_ONLY_ROWS rows fp8_linear runs weight-only, above them fp8 x fp8."""
    gen = torch.Generator().manual_seed(1)
    q, scale_inv = quantize_fp8_blockwise((0.1 * torch.randn(32, 130, generator=gen)).to(device))
    few = fp8_matmul.CONFIG["WEIGHT_ONLY_ROWS"]
    for N, weight_only in ((1, True), (few, True), (few + 1, False)):
        x = torch.randn(N, 130, generator=gen).to(device)
        assert fp8_matmul.weight_only(N) == weight_only
        want = fp8_linear(x, q, scale_inv, quantize_input=not weight_only)
        assert torch.equal(fp8_linear(x, q, scale_inv), want)


def check_engine_weight_only(device: str) -> None:
    """An fp32 block-fp8 engine whose matmuls all run the weight-only kernel (prefill and decode
    rows are few) gives the tokens of its dequantizing path and log-probs within 1e-4."""
    torch.manual_seed(0)
    cfg = tiny_config(dim=128, num_layers=1, mlp_hidden=128, num_kv_heads=2, mtp_depth=0)
    model = Transformer(cfg)
    engine = Engine.from_model(model.to(device).eval(), device=device, dtype=torch.float32,
                               quantize="fp8", cuda_graphs=False)  # fmt: skip
    calls = []
    real = fp8_matmul.fp8_linear

    def spy(x, q, s, *, quantize_input=None):  # type: ignore[no-untyped-def]
        calls.append(fp8_matmul.weight_only(x.numel() // x.shape[-1]) and not quantize_input)
        return real(x, q, s, quantize_input=quantize_input)

    params = SamplingParams(3)
    prompts = [[1, 2, 3, 4], [5, 6]]
    supported = fp8_matmul.supported
    fp8_matmul.fp8_linear = spy  # type: ignore[assignment]
    try:
        out = engine.generate(prompts, params)
        fp8_matmul.fp8_linear, fp8_matmul.supported = real, lambda x: False  # type: ignore
        ref = engine.generate(prompts, params)
    finally:
        fp8_matmul.fp8_linear, fp8_matmul.supported = real, supported  # type: ignore
    assert calls and all(calls)
    for got, want in zip(out, ref, strict=True):
        assert got.tokens == want.tokens
        drift = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
        assert drift < 1e-4, drift


INTERPRETED = """
import sys
sys.path.insert(0, {tests!r})
import torch
from test_fp8_matmul import check_engine_weight_only, check_kernel, check_mode_rule
from birkhoff.kernels import fp8_matmul
assert fp8_matmul.supported(torch.zeros(1))
check_kernel("cpu", torch.float32, [(3, 200, 130), (1, 96, 40)])
check_kernel("cpu", torch.bfloat16, [(20, 256, 64)])
check_mode_rule("cpu")
check_engine_weight_only("cpu")
print("ok")
"""


@pytest.mark.slow
def test_kernel_in_the_triton_interpreter() -> None:
    """The kernel runs on CPU only in the interpreter, which must be on before Triton compiles
    anything: a fresh interpreter process."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    code = INTERPRETED.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_activation_quantization_reference() -> None:
    x_NX = torch.tensor([[1.0, -2.0, 0.5] + [0.0] * 130, [0.0] * 133])
    q_NX, scale_NG = quantize_activation(x_NX)
    assert q_NX.shape == (2, 133) and scale_NG.shape == (2, 2)
    assert scale_NG[0, 0] == 2.0 / 448 and q_NX[0, 1].float() == -448.0
    assert torch.equal(q_NX[1].float(), torch.zeros(133))  # all-zero groups stay zero


hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)",
)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_gpu(dtype: torch.dtype) -> None:
    check_kernel("cuda", dtype, SHAPES)
    check_mode_rule("cuda")
    x = torch.randn(37, 300, device="cuda")
    for got, want in zip(quantize_activation_cuda(x), quantize_activation(x), strict=True):
        assert torch.equal(got.float(), want.float())  # bit-identical codes and scales


@pytest.mark.gpu
@hopper
def test_weight_only_fp8_engine_on_gpu_equals_its_dequantizing_path() -> None:
    check_engine_weight_only("cuda")


@pytest.mark.gpu
@hopper
def test_fp8_engine_on_gpu_close_to_dequantized(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8 engine on the GPU (fp8 matmuls, CUDA graphs) vs the same weights dequantized."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(dim=256, num_heads=4, num_kv_heads=2)).cuda().eval()
    kw = dict(device="cuda", dtype=torch.bfloat16, max_batch_size=4)
    fp8 = Engine.from_model(model, quantize="fp8", **kw)  # type: ignore[arg-type]
    ref = Engine.from_model(model, quantize="fp8", cuda_graphs=False, **kw)  # type: ignore[arg-type]
    prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(6, temperature=1.0, seed=0)
    out = fp8.generate(prompts, params)
    monkeypatch.setattr(fp8_matmul, "supported", lambda x: False)  # the dequantizing path
    ref_out = ref.generate(prompts, params)
    assert all(len(c.tokens) == 6 for c in out)
    drift = max(abs(a - b) for c, r in zip(out, ref_out, strict=True)
                for a, b in zip(c.logprobs, r.logprobs, strict=True))  # fmt: skip
    assert drift < 0.1
