"""DeepSeek's original V4 tensor names: against transformers' own renaming rules, both ways."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from birkhoff.engine.fp8 import quantize_fp8_blockwise
from birkhoff.interop.streaming import TensorSpec
from birkhoff.interop.v4_deepseek import (
    V4Source,
    deepseek_name,
    deepseek_tensors,
    transformers_name,
)

transformers = pytest.importorskip("transformers")
from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: E402
from transformers.core_model_loading import (  # noqa: E402
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

CONFIG = dict(
    vocab_size=40, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, head_dim=16, q_lora_rank=8, o_lora_rank=8, o_groups=2,
    n_routed_experts=3, num_experts_per_tok=2, index_n_heads=2, index_head_dim=16,
    mlp_layer_types=["hash_moe", "moe", "moe"],
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention"],
)  # fmt: skip


class DictSource:
    """A TensorSource over a dict."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def spec(self, name: str) -> TensorSpec:
        return TensorSpec(tuple(self.tensors[name].shape), self.tensors[name].dtype)

    def get(self, name: str) -> Tensor:
        return self.tensors[name]


def reference_state() -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**CONFIG))
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def transformers_rename(original: str, meta: dict[str, Tensor]) -> str:
    """What transformers' loader calls DeepSeek tensor `original` (its "deepseek_v4" rules)."""
    rules = get_checkpoint_conversion_mapping("deepseek_v4")
    renames = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    return rename_source_key(original, renames, converters, "model", meta)[0]


def test_original_names_are_what_transformers_renames_to_its_own() -> None:
    state = reference_state()
    for name, tensor in state.items():
        for original, _ in deepseek_tensors(name, tensor):
            assert transformers_rename(original, state) == name, original
            if ".experts." not in original:
                assert transformers_name(original) == name
                assert deepseek_name(name) == original
    assert deepseek_name("model.layers.0.self_attn.sinks") == "layers.0.attn.attn_sink"
    assert deepseek_name("model.hc_head.hc_fn") == "hc_head_fn"
    assert transformers_name("layers.2.attn.wq_a.scale") == (
        "model.layers.2.self_attn.q_a_proj.weight_scale_inv"
    )
    assert transformers_name("layers.2.attn_hc.scale") is None  # an mHC scale, not a block scale


def test_mtp_keeps_its_own_names_and_renames_its_layer_tensors() -> None:
    assert transformers_name("mtp.0.attn.wq_a.weight") == "mtp.0.self_attn.q_a_proj.weight"
    assert transformers_name("mtp.0.hc_attn_fn") == "mtp.0.attn_hc.fn"
    assert transformers_name("mtp.0.ffn.gate.bias") == "mtp.0.mlp.gate.e_score_correction_bias"
    for own in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
                "hc_head_fn", "hc_head_base", "hc_head_scale"):  # fmt: skip
        assert transformers_name(f"mtp.1.{own}") == f"mtp.1.{own}"
        assert deepseek_name(f"mtp.1.{own}") == f"mtp.1.{own}"
    assert transformers_name("mtp.0.e_proj.scale") == "mtp.0.e_proj.weight_scale_inv"


def test_source_reads_either_layout_or_a_mix_as_transformers_names() -> None:
    state = reference_state()
    original = {n: t for name, tensor in state.items() for n, t in deepseek_tensors(name, tensor)}
    assert "layers.1.ffn.experts.2.w3.weight" in original
    mixed = {k: v for k, v in state.items() if not k.startswith("model.layers.2.")}
    mixed |= {k: v for k, v in original.items() if k.startswith("layers.2.")}
    for tensors in (state, original, mixed):
        source = V4Source(DictSource(tensors))
        assert source.names() == sorted(state)
        for name, tensor in state.items():
            assert source.spec(name) == TensorSpec(tuple(tensor.shape), tensor.dtype)
            assert torch.equal(source.get(name), tensor), name


def test_fp8_experts_are_dequantized_as_they_are_stacked() -> None:
    state = reference_state()
    original = {}
    for name, tensor in state.items():
        for n, t in deepseek_tensors(name, tensor):
            if ".experts." in n:
                q, scale = quantize_fp8_blockwise(t)
                original |= {n: q, n.removesuffix(".weight") + ".scale": scale}
            else:
                original[n] = t
    source = V4Source(DictSource(original), fp8_dtype=torch.float64)
    stack = "model.layers.1.mlp.experts.gate_up_proj"
    assert source.spec(stack) == TensorSpec((3, 32, 32), torch.float64)
    got, want = source.get(stack), state[stack].double()
    assert (got - want).abs().max() <= want.abs().amax() / 16
    del original["layers.1.ffn.experts.1.w3.scale"]
    with pytest.raises(ValueError, match="gate_up_proj: expert 1 has no w3.scale"):
        V4Source(DictSource(original))


def test_two_tensors_with_one_name_are_refused() -> None:
    tensors = {"embed.weight": torch.zeros(2), "model.embed_tokens.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="are both model.embed_tokens.weight"):
        V4Source(DictSource(tensors))
