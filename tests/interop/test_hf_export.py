"""HF export: import -> export is bit-identical; native S=1 models load in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_helpers import CASES, build_hf_model, hf_logits, save_hf_model
from safetensors import safe_open

from birkhoff.config import ModelConfig
from birkhoff.interop.hf import export_hf, import_hf
from birkhoff.model.transformer import Transformer
from birkhoff.runtime.checkpoint import CheckpointError, save_checkpoint

transformers = pytest.importorskip("transformers")


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return tensors


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_is_bit_identical(case: str, tmp_path: Path) -> None:
    hf_model = build_hf_model(case).to(torch.bfloat16)
    save_hf_model(hf_model, tmp_path / "hf", sharded=case.startswith("qwen"))
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    import_hf(tmp_path / "hf", tmp_path / "ckpt", max_seq_len=64)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    for name in ("config.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    before, after = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name


def test_native_model_exports_to_transformers(tmp_path: Path) -> None:
    cfg = ModelConfig(vocab_size=50, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      num_streams=1, mtp_depth=0, qkv_bias=True, qk_norm=True, attn_out_bias=True,
                      tie_embeddings=True, rope_scaling="llama3", rope_factor=4.0,
                      rope_original_max_seq_len=16)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_checkpoint(tmp_path / "ckpt", model, step=3)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "qwen3"
    ids_BT = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids_BT).logits, hf_logits(hf_model, ids_BT), atol=1e-4,
                                   rtol=0)  # fmt: skip


def test_export_refuses_streams_mtp_and_corruption(tmp_path: Path) -> None:
    save_hf_model(build_hf_model("llama-gqa"), tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "wide", num_streams=2)
    with pytest.raises(ValueError, match="num_streams=2"):
        export_hf(tmp_path / "wide", tmp_path / "out")
    import_hf(tmp_path / "hf", tmp_path / "mtp", mtp_depth=1)
    with pytest.raises(ValueError, match="drop_mtp"):
        export_hf(tmp_path / "mtp", tmp_path / "out")
    export_hf(tmp_path / "mtp", tmp_path / "out", drop_mtp=True)
    assert sorted(hf_tensors(tmp_path / "out")) == sorted(hf_tensors(tmp_path / "hf"))
    model_file = tmp_path / "mtp" / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-1] ^= 1
    model_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        export_hf(tmp_path / "mtp", tmp_path / "out2")
