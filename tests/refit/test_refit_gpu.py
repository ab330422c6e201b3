"""refit() on CUDA: bit-identical to a direct load; GPU fp8 codes equal CPU fp8 codes."""

from __future__ import annotations

import pytest
import torch
from refit_helpers import make_model, tiny_config

from birkhoff.engine import Engine
from birkhoff.engine.sampling import SamplingParams
from birkhoff.refit import refit
from birkhoff.refit.fp8 import quantize_fp8_blockwise
from birkhoff.refit.plan import current_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_quantize_matches_cpu_bits(dtype: torch.dtype) -> None:
    w = (torch.randn(300, 520, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    q_cpu, s_cpu = quantize_fp8_blockwise(w)
    q_gpu, s_gpu = quantize_fp8_blockwise(w.cuda())
    assert q_gpu.is_cuda and s_gpu.is_cuda
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    assert torch.equal(s_gpu.cpu(), s_cpu)


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
    for name, t in direct.weights.items():
        got = engine.weights[name]
        assert got.is_cuda and got.dtype == t.dtype, name
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name


def test_cuda_replays_reuse_two_banks_and_stay_exact() -> None:
    """Replays write the bank a generation read two versions ago: one stream orders them."""
    cfg = tiny_config(dim=256, num_heads=4, vocab_size=1000)
    model = make_model(cfg, seed=0).cuda()
    kw = dict(device="cuda", dtype=torch.bfloat16, max_batch_size=2)
    engine = Engine.from_model(make_model(cfg, seed=1).cuda(), **kw)
    prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=8)
    for step in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        refit(model, engine, bucket_bytes=1 << 16)
        direct = Engine.from_model(model, **kw)
        for name, t in direct.weights.items():
            assert torch.equal(engine.weights[name].view(torch.uint8), t.view(torch.uint8)), name
        got = [c.tokens for c in engine.generate(prompts, params)]
        assert got == [c.tokens for c in direct.generate(prompts, params)], step
    plan = current_plan(model)
    assert plan is not None and plan.banks_made == 2
