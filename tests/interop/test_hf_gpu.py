"""GPU: an imported, upcycled checkpoint on CUDA matches transformers there (fp32 and bf16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_helpers import build_hf_model, hf_logits, save_hf_model

from birkhoff.interop.hf import import_hf
from birkhoff.train.checkpoint import load_checkpoint

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
