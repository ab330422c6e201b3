"""DeepSeek-V4 config.json <-> ModelConfig: both spellings, the inverse, refused fields."""

from __future__ import annotations

from typing import Any

import pytest

from birkhoff.interop.v4_config import model_config_from_v4, v4_config_from_model

transformers = pytest.importorskip("transformers")

# DeepSeek-V4-Flash's released config.json (the legacy spelling transformers folds on load)
FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-06,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu",
    "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
    "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6,
    "num_hidden_layers": 43, "num_hash_layers": 3, "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                     "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
    "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": False,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
    "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}  # fmt: skip
TINY = dict(
    vocab_size=61, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
    q_lora_rank=12, partial_rotary_factor=0.5, o_groups=2, o_lora_rank=8, index_n_heads=2,
    index_head_dim=12, index_topk=3, moe_intermediate_size=24, n_routed_experts=4,
    num_experts_per_tok=2, sliding_window=6, num_nextn_predict_layers=2,
    max_position_embeddings=1024,
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    rope_parameters={"rope_type": "yarn", "factor": 4.0,
                     "original_max_position_embeddings": 256, "beta_fast": 16.0},
)  # fmt: skip


def test_released_flash_config_maps_field_by_field() -> None:
    cfg = model_config_from_v4(FLASH, max_seq_len=4096)
    v4, moe = cfg.attention, cfg.moe
    assert v4 is not None and moe is not None
    assert (cfg.dim, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.num_streams) == (
        4096, 43, 64, 1, 4)  # fmt: skip
    assert (cfg.mtp_depth, cfg.max_seq_len, cfg.rope_theta, cfg.vocab_size) == (
        1, 4096, 10000.0, 129280)  # fmt: skip
    assert v4.layer_types[:4] == (
        "sliding_attention",
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    )
    assert (v4.head_dim, v4.qk_rope_head_dim, v4.q_lora_rank, v4.compress_rope_theta) == (
        512, 64, 1024, 160000.0)  # fmt: skip
    assert (moe.num_experts, moe.experts_per_token, moe.expert_hidden, moe.num_hash_layers) == (
        256, 6, 2048, 3)  # fmt: skip
    assert (moe.scoring, moe.route_scale, moe.swiglu_limit, moe.balance_loss) == (
        "sqrtsoftplus", 1.5, 10.0, "switch")  # fmt: skip
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_seq_len) == ("yarn", 16, 65536)


def test_transformers_config_round_trips_both_ways() -> None:
    hf = transformers.DeepseekV4Config(**TINY).to_dict()
    cfg = model_config_from_v4(hf)
    assert cfg.mtp_depth == 2 and cfg.rope_scaling == "yarn" and cfg.rope_beta_fast == 16.0
    back = v4_config_from_model(cfg)
    assert model_config_from_v4(back) == cfg
    # transformers reads what we write as the same config
    again = transformers.DeepseekV4Config(**back).to_dict()
    for key in ("layer_types", "mlp_layer_types", "compress_rates",
                "qk_rope_head_dim", "swiglu_limit", "num_nextn_predict_layers"):  # fmt: skip
        assert again[key] == hf[key], key
    for rope in ("main", "compress"):  # ours also names yarn's defaults (beta_slow, truncate)
        ours, theirs = again["rope_parameters"][rope], hf["rope_parameters"][rope]
        assert {k: ours[k] for k in theirs} == theirs
    # the legacy spelling of the same model gives the same config
    flash_cfg = model_config_from_v4(FLASH)
    assert model_config_from_v4(v4_config_from_model(flash_cfg)) == flash_cfg


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"new_knob": 1}, r"unknown DeepSeek-V4 field\(s\) \['new_knob'\]"),
        ({"n_shared_experts": 2}, "n_shared_experts=2"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False"),
        ({"expert_dtype": "fp4"}, "expert_dtype='fp4'"),
        ({"num_key_value_heads": 4}, "num_key_value_heads=4"),
        ({"compress_ratios": [0, 0] + [4, 128] * 20 + [4, 4]}, r"compress_ratios\[43\]=4"),
        ({"compress_ratios": [0, 2] + [4, 128] * 20 + [4, 0]}, "compress_ratios="),
        ({"mlp_layer_types": ["moe", "hash_moe"] + ["moe"] * 41}, "mlp_layer_types="),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}},
         "quantization_config.weight_block_size"),
        ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 8,
                           "attention_factor": 1.3}}, "attention_factor=1.3"),
        ({"model_type": "deepseek_v3"}, "model_type='deepseek_v3'"),
    ],
)  # fmt: skip
def test_unsupported_fields_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_config_from_v4({**FLASH, **change})


def test_mtp_depth_and_context_overrides_are_checked() -> None:
    assert model_config_from_v4(FLASH, mtp_depth=0).mtp_depth == 0
    with pytest.raises(ValueError, match="mtp_depth=2 is invalid"):
        model_config_from_v4(FLASH, mtp_depth=2)
    with pytest.raises(ValueError, match="max_seq_len=2000000 is invalid"):
        model_config_from_v4(FLASH, max_seq_len=2_000_000)
    cfg = model_config_from_v4(FLASH)
    with pytest.raises(ValueError, match="moe.num_dense_layers=1"):
        v4_config_from_model(cfg.replace(moe=cfg.moe.__class__.from_dict(
            {**_fields(cfg.moe), "num_dense_layers": 1})))  # fmt: skip


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}
