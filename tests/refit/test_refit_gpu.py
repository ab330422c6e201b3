"""refit() on CUDA: bit-identical to a direct load; GPU fp8 codes equal CPU fp8 codes."""

from __future__ import annotations

import pytest
import torch
from refit_helpers import make_model, tiny_config

from birkhoff.engine import Engine
from birkhoff.engine.fp8 import quantize_fp8_blockwise, quantize_fp8_blockwise_eager
from birkhoff.engine.sampling import SamplingParams
from birkhoff.kernels import fp8_quantize
from birkhoff.refit import refit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def special_weight(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Random weights with an all-zero block, a huge block, a tiny (subnormal-coded) block."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)) * 0.02
    if rows >= 256 and cols >= 256:
        w[:128, :128] = 0
        w[128:256, :128] *= 1e4
        w[:128, 128:256] *= 1e-30
    return w.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.itemsize == 1 else t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(300, 520), (6144, 2048), (2048, 5464), (10928, 256), (1, 7)])
@pytest.mark.parametrize("impl", ["dispatch", "eager"])
def test_gpu_quantize_matches_cpu_bits(
    dtype: torch.dtype, shape: tuple[int, int], impl: str
) -> None:
    """CUDA codes and scales equal the CPU reference bit for bit (fused kernel and eager)."""
    w = special_weight(*shape, dtype)
    q_cpu, s_cpu = quantize_fp8_blockwise_eager(w)
    quantize = quantize_fp8_blockwise if impl == "dispatch" else quantize_fp8_blockwise_eager
    q_gpu, s_gpu = quantize(w.cuda())
    assert q_gpu.is_cuda and s_gpu.is_cuda and q_gpu.shape == w.shape
    assert torch.equal(bits(q_gpu.cpu()), bits(q_cpu))
    assert torch.equal(bits(s_gpu.cpu()), bits(s_cpu))


def test_fused_kernel_is_used_and_handles_non_finite_blocks() -> None:
    pytest.importorskip("triton")
    w = special_weight(256, 384, torch.float32).cuda()
    assert fp8_quantize.supported(w, 128)
    w[0, 200] = float("nan")  # block (0, 1)
    w[200, 300] = float("inf")  # block (1, 2)
    q, s = quantize_fp8_blockwise(w)
    q_ref, s_ref = quantize_fp8_blockwise_eager(w.cpu())
    assert torch.isnan(s[0, 1]) and torch.isnan(s_ref[0, 1])
    assert torch.isinf(s[1, 2]) and torch.isinf(s_ref[1, 2])
    finite = torch.isfinite(s_ref)
    assert torch.equal(bits(s.cpu())[finite], bits(s_ref)[finite])
    assert torch.equal(q.float().cpu().isnan(), q_ref.float().isnan())
    assert torch.equal(bits(q.cpu())[:128, :128], bits(q_ref)[:128, :128])


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 26])
def test_cuda_refit_equals_direct_load(quantize: str | None, bucket_bytes: int) -> None:
    cfg = tiny_config(dim=256, num_heads=4, vocab_size=1000)
    model_a, model_b = make_model(cfg, seed=0).cuda(), make_model(cfg, seed=1).cuda()
    kw = dict(device="cuda", dtype=torch.bfloat16, quantize=quantize, max_batch_size=2)
    engine = Engine.from_model(model_a, **kw)
    report = refit(model_b, engine, bucket_bytes=bucket_bytes, quantize=quantize,
                   check_finite=True)  # fmt: skip
    direct = Engine.from_model(model_b, **kw)
    assert report.version == 1
    for name, t in direct.committed.items():
        got = engine.committed[name]
        assert got.is_cuda and got.dtype == t.dtype, name
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("bucket_bytes", [1 << 16, 1 << 26])
def test_cuda_refits_reuse_two_banks_and_stay_exact(
    quantize: str | None, bucket_bytes: int
) -> None:
    """Refits write the bank a generation read two versions ago: one stream orders them."""
    cfg = tiny_config(dim=256, num_heads=4, vocab_size=1000)
    model = make_model(cfg, seed=0).cuda()
    kw = dict(device="cuda", dtype=torch.bfloat16, max_batch_size=2, quantize=quantize)
    engine = Engine.from_model(make_model(cfg, seed=1).cuda(), **kw)
    prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=8)
    served, read = [], []
    for step in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        refit(model, engine, bucket_bytes=bucket_bytes, quantize=quantize)
        direct = Engine.from_model(model, **kw)
        for name, t in direct.committed.items():
            assert torch.equal(engine.committed[name].view(torch.uint8), t.view(torch.uint8)), name
        got = [c.tokens for c in engine.generate(prompts, params)]
        assert got == [c.tokens for c in direct.generate(prompts, params)], step
        served.append({t.untyped_storage().data_ptr() for t in engine.committed.values()})
        read.append({t.data_ptr() for t in engine.weights.values()})  # phi re-laid: its own
    if bucket_bytes == 1 << 26:  # no split tensor: every served tensor lives in a bank
        assert served[1] == served[3] and served[2] == served[4] and served[1] != served[2]
        assert read[1] == read[3] and read[2] == read[4]  # so the graph sets are reused
