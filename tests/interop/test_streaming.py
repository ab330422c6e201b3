"""Streaming safetensors IO, the one-tensor-at-a-time import, the tied lm_head and the CLI entry."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from hf_helpers import build_hf_model, save_hf_model
from safetensors.torch import load_file, save_file

from birkhoff.cli import main
from birkhoff.interop.hf import import_hf
from birkhoff.interop.streaming import SafetensorsSource, StreamingWriter, TensorSpec
from birkhoff.runtime.checkpoint import load_checkpoint


def test_streaming_writer_is_readable_by_safetensors(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b.c": torch.arange(7, dtype=torch.int64),
        "d": torch.randn(2, 2, 2, dtype=torch.float64)[:, 1],  # non-contiguous
        "e": torch.zeros(0),
    }
    plan = [(name, TensorSpec(tuple(t.shape), t.dtype)) for name, t in tensors.items()]
    writer = StreamingWriter(tmp_path / "x.safetensors", plan, {"format": "pt"})
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    num_bytes, _ = writer.close()
    assert num_bytes == (tmp_path / "x.safetensors").stat().st_size
    loaded = load_file(tmp_path / "x.safetensors")
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)


def test_import_holds_one_source_tensor_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_hf_model(build_hf_model("llama-gqa"), tmp_path / "hf", sharded=True)
    alive: list[weakref.ref[torch.Tensor]] = []
    original_get = SafetensorsSource.get

    def tracking_get(self: SafetensorsSource, name: str) -> torch.Tensor:
        assert all(ref() is None for ref in alive), "an earlier tensor is still referenced"
        tensor = original_get(self, name)
        alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(SafetensorsSource, "get", tracking_get)
    import_hf(tmp_path / "hf", tmp_path / "ckpt", num_streams=2, mtp_depth=1)
    assert len(alive) > 20  # every dense tensor, plus the last layer again for the MTP block


def test_tied_lm_head_in_the_source_must_equal_the_embedding(tmp_path: Path) -> None:
    save_hf_model(build_hf_model("qwen2-bias"), tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(file)
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}, file)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    save_file({**state, "lm_head.weight": torch.zeros_like(state["model.embed_tokens.weight"])},
              file)  # fmt: skip
    with pytest.raises(ValueError, match="lm_head.weight != embed_tokens"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt2")


def test_command_line_import_and_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    save_hf_model(build_hf_model("llama-gqa"), tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"),
                 "--streams", "2", "--mtp-depth", "1", "--max-seq-len", "64"]) == 0  # fmt: skip
    cfg = load_checkpoint(tmp_path / "ckpt").config
    assert (cfg.num_streams, cfg.mtp_depth, cfg.max_seq_len) == (2, 1, 64)
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "dense")]) == 0
    assert main(["export-hf", str(tmp_path / "dense"), "--out", str(tmp_path / "out")]) == 0
    assert str(tmp_path / "out") in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors").is_file()
