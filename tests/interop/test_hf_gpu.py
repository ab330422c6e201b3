"""GPU: an imported, upcycled checkpoint on CUDA matches transformers there (fp32 and bf16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_helpers import build_hf_model, hf_logits, save_hf_model

from birkhoff.interop.hf import import_hf
from birkhoff.runtime.checkpoint import load_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("case", ["llama-tied-llama3", "qwen2-bias", "qwen3-qknorm", "llama-yarn"])
def test_imported_logits_on_cuda(case: str, tmp_path: Path) -> None:
    hf_model = build_hf_model(case)
    save_hf_model(hf_model, tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt", num_streams=4, mtp_depth=1)
    model = load_checkpoint(tmp_path / "ckpt").model.cuda().eval()
    ids_BT = torch.randint(0, 97, (4, 64), device="cuda")
    ref_BTV = hf_logits(hf_model.cuda(), ids_BT)
    with torch.no_grad():
        torch.testing.assert_close(model(ids_BT).logits, ref_BTV, atol=1e-3, rtol=0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16_BTV = model(ids_BT).logits.float()
    assert (bf16_BTV - ref_BTV).abs().max() < 0.1 * ref_BTV.abs().max()


@pytest.mark.parametrize("case", ["llama-linear-bias", "qwen2-bias", "qwen3-qknorm", "llama-yarn"])
def test_imported_engine_on_cuda(case: str, tmp_path: Path) -> None:
    """fp32 engine greedy tokens equal the trainer's on CUDA; bf16 and fp8 engines serve it too."""
    from birkhoff.engine import Engine, SamplingParams

    save_hf_model(build_hf_model(case), tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "ckpt", num_streams=2, mtp_depth=1)
    model = load_checkpoint(tmp_path / "ckpt").model.cuda().eval()
    prompts = [[5, 17, 3], [60, 2, 9, 41, 88, 7, 12]]
    engine = Engine.from_model(model, device="cuda", max_batch_size=4)
    for prompt, completion in zip(
        prompts, engine.generate(prompts, SamplingParams(16)), strict=True
    ):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                ids.append(int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
        assert completion.tokens == ids[len(prompt) :]
    for kwargs in ({"dtype": torch.bfloat16}, {"dtype": torch.bfloat16, "quantize": "fp8"}):
        served = Engine.from_model(model, device="cuda", max_batch_size=4, **kwargs)
        params = SamplingParams(16, num_speculative_tokens=1)
        assert all(len(c.tokens) == 16 for c in served.generate(prompts, params))
