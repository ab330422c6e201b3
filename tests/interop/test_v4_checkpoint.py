"""DeepSeek-V4 checkpoints: names vs transformers, streamed import/export, fp8, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from birkhoff.engine.fp8 import dequantize_fp8_blockwise
from birkhoff.interop.v4_checkpoint import export_tensors, export_v4, import_v4
from birkhoff.interop.v4_config import model_config_from_v4, v4_config_from_model
from birkhoff.interop.v4_names import SCALE_SUFFIX, hf_parts
from birkhoff.model import Transformer
from birkhoff.runtime.checkpoint import load_checkpoint

transformers = pytest.importorskip("transformers")

CONFIG = dict(
    vocab_size=40, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, head_dim=16, q_lora_rank=8, o_lora_rank=8, o_groups=2,
    n_routed_experts=4, num_experts_per_tok=2, hc_mult=4, index_n_heads=2, index_head_dim=16,
    mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=4, index_topk=2,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention"],
)  # fmt: skip
# V4's attention (all three kinds), MoE (hash + top-k), mHC, MTP and top-level tensors
CFG = model_config_from_v4(transformers.DeepseekV4Config(**CONFIG).to_dict())


def v4_reference_names() -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a tiny transformers DeepseekV4ForCausalLM like CFG."""
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**CONFIG))
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


def test_every_tensor_maps_to_transformers_with_its_shape() -> None:
    with torch.device("meta"):
        ours = Transformer(CFG).state_dict()
    mapped = {}
    for name, tensor in ours.items():
        parts = hf_parts(name)
        assert parts is not None, name
        if name.startswith("mtp."):
            continue  # transformers drops MTP
        shape = list(tensor.shape)
        shape[parts.dim] //= len(parts.names)
        mapped |= {part: tuple(shape) for part in parts.names}
    assert mapped == v4_reference_names()


def test_mtp_depth_maps_to_the_checkpoints_mtp_names() -> None:
    with torch.device("meta"):
        names = [n for n in Transformer(CFG).state_dict() if n.startswith("mtp.0.")]
    hf = {part for n in names for part in hf_parts(n).names}  # type: ignore[union-attr]
    for piece in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
                  "hc_head_fn", "hc_head_base", "hc_head_scale",
                  "input_layernorm.weight", "attn_hc.fn", "mlp.gate.e_score_correction_bias",
                  "mlp.experts.gate_up_proj", "mlp.shared_experts.up_proj.weight"):  # fmt: skip
        assert f"mtp.0.{piece}" in hf
    assert all(n.startswith("mtp.0.") for n in hf)


def write_v4_dir(
    directory: Path, model: Transformer, *, fp8: bool = False
) -> dict[str, torch.Tensor]:
    """A V4 checkpoint directory of `model`'s weights (transformers' names + mtp.*)."""
    directory.mkdir(parents=True)
    tensors = {}
    for name, tensor in model.state_dict().items():
        tensors |= dict(export_tensors(name, tensor, fp8=fp8))
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(v4_config_from_model(CFG)))
    return tensors


def model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(CFG)
    with torch.no_grad():
        for buf in m.buffers():
            if buf.dtype == torch.float32 and buf.numel() > 1:
                buf.normal_()  # the router biases
    return m


def test_import_then_export_round_trips_bit_for_bit(tmp_path: Path) -> None:
    ours = model()
    written = write_v4_dir(tmp_path / "v4", ours)
    ckpt = import_v4(tmp_path / "v4", tmp_path / "ckpt", CFG)
    loaded = load_checkpoint(ckpt).model
    for name, tensor in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    export_v4(ckpt, tmp_path / "out")
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert back.keys() == written.keys()
    assert all(torch.equal(back[n], written[n]) for n in written)
    assert (tmp_path / "out" / "config.json").read_bytes() == (
        tmp_path / "v4" / "config.json"
    ).read_bytes()


def test_fp8_checkpoint_imports_within_the_block_tolerance(tmp_path: Path) -> None:
    ours = model()
    written = write_v4_dir(tmp_path / "v4", ours, fp8=True)
    assert written["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    ckpt = import_v4(tmp_path / "v4", tmp_path / "ckpt", CFG)
    loaded = load_checkpoint(ckpt).model.state_dict()
    for name, tensor in ours.state_dict().items():
        # e4m3 keeps 3 mantissa bits: |error| <= 2^-4 of the block's amax (one 128x128 block here)
        bound = tensor.abs().amax().item() / 16 if tensor.is_floating_point() else 0
        assert (loaded[name] - tensor).abs().max().item() <= bound, name
    # re-quantizing the dequantized weights gives the same weights (scales to an fp32 ulp)
    export_v4(ckpt, tmp_path / "out", fp8=True)
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert back.keys() == written.keys()
    for n in written:
        if n.endswith(SCALE_SUFFIX):
            continue
        if written[n].dtype == torch.float8_e4m3fn:
            s = n + SCALE_SUFFIX
            ref = dequantize_fp8_blockwise(written[n], written[s])
            got = dequantize_fp8_blockwise(back[n], back[s])
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
        else:
            assert torch.equal(back[n], written[n]), n


def test_bad_checkpoints_name_the_tensor(tmp_path: Path) -> None:
    tensors = write_v4_dir(tmp_path / "v4", model())
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != "mtp.0.e_proj.weight"},
                    "missing tensors: \\['mtp.0.e_proj.weight'\\]"),
        "shape": ({**tensors, "model.layers.0.mlp.gate.weight": torch.zeros(5, 32)},
                  "model.layers.0.mlp.gate.weight: shape \\(5, 32\\)"),
        "unknown": ({**tensors, "model.layers.0.mlp.extra": torch.zeros(1)},
                    "no birkhoff equivalent: \\['model.layers.0.mlp.extra'\\]"),
        "scale": ({**tensors, "lm_head.weight": tensors["lm_head.weight"].to(torch.float8_e4m3fn)},
                  "lm_head.weight: fp8 weight without its block scales"),
        "scale-shape": ({**tensors, "lm_head.weight" + SCALE_SUFFIX: torch.ones(3, 3)},
                        "lm_head.weight_scale_inv: shape \\(3, 3\\)"),
    }  # fmt: skip
    for case, (bad, message) in cases.items():
        directory = tmp_path / case
        directory.mkdir()
        save_file(bad, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(v4_config_from_model(CFG)))
        with pytest.raises(ValueError, match=message):
            import_v4(directory, tmp_path / f"ckpt-{case}", CFG)
        assert not (tmp_path / f"ckpt-{case}").exists()
