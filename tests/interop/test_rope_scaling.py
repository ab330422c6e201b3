"""Rope scaling variants against transformers' rope init functions, and config validation."""

from __future__ import annotations

import pytest
import torch

from birkhoff.config import ModelConfig
from birkhoff.interop.hf_config import model_config_from_hf
from birkhoff.model.layers import rope_inv_freq, rope_tables

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

ROPES = {
    "linear": {"factor": 3.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-untruncated": {"factor": 4.0, "original_max_position_embeddings": 64,
                         "truncate": False, "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn-mscale": {"factor": 4.0, "original_max_position_embeddings": 64,
                    "mscale": 1.0, "mscale_all_dim": 0.5},
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(ROPES))
def test_inv_freq_and_scale_match_transformers(variant: str) -> None:
    params = {"rope_type": variant.split("-")[0], "rope_theta": 10000.0, **ROPES[variant]}
    hf_cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=512, rope_parameters=params
    )
    ref_inv_freq, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    cfg = model_config_from_hf(hf_cfg.to_dict())
    positions_BT = torch.arange(300)[None, :]
    cos, sin = rope_tables(positions_BT, cfg.head_dim, cfg.rope_theta, cfg=cfg)
    plain_cos, _ = rope_tables(positions_BT, cfg.head_dim, cfg.rope_theta)
    angles = positions_BT.double()[..., None] * ref_inv_freq.double()
    torch.testing.assert_close(cos, angles.cos() * ref_scale, atol=5e-5, rtol=0)
    torch.testing.assert_close(sin, angles.sin() * ref_scale, atol=5e-5, rtol=0)
    assert (cos - plain_cos).abs().max() > 0.1  # the variant really changes the tables
    assert cfg.rope_attention_factor == pytest.approx(ref_scale, rel=1e-12)


def test_no_scaling_is_plain_rope() -> None:
    cfg = ModelConfig(vocab_size=8, dim=32, num_layers=1, num_heads=2)
    positions_BT = torch.arange(10)[None, :]
    plain = rope_tables(positions_BT, 16, 10000.0)
    for a, b in zip(plain, rope_tables(positions_BT, 16, 10000.0, cfg=cfg), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        rope_inv_freq(16, 10000.0), 10000.0 ** (-torch.arange(0, 16, 2).double() / 16)
    )


BASE = dict(vocab_size=8, dim=32, num_layers=1, num_heads=2)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"rope_scaling": "dynamic"}, "rope_scaling"),
        ({"rope_scaling": "linear", "rope_factor": 0.0}, "rope_factor"),
        ({"rope_scaling": "llama3"}, "rope_original_max_seq_len"),
        ({"rope_scaling": "yarn", "rope_original_max_seq_len": 0}, "rope_original_max_seq_len"),
        ({"rope_scaling": "llama3", "rope_original_max_seq_len": 8, "rope_high_freq_factor": 0.5},
         "rope_high_freq_factor"),
        ({"rope_attention_factor": 2.0}, "rope_attention_factor"),
        ({"qk_norm": 1}, "qk_norm"),
        ({"attn_head_dim": 3}, "head_dim"),
        ({"dim": 30, "num_heads": 4}, "dim"),
    ],
)  # fmt: skip
def test_invalid_options_name_field_and_value(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**BASE, **changes})


def test_head_dim_override_and_json_round_trip() -> None:
    import json

    cfg = ModelConfig(**{**BASE, "dim": 30, "num_heads": 4, "attn_head_dim": 16, "qk_norm": True,
                         "rope_scaling": "yarn", "rope_original_max_seq_len": 16,
                         "rope_factor": 2.0, "rope_attention_factor": 1.07})  # fmt: skip
    assert cfg.head_dim == 16
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
