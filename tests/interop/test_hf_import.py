"""Import of tiny random HF Llama-family checkpoints: logits equal transformers' forward in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_helpers import CASES, build_hf_model, hf_logits, save_hf_model

from birkhoff.config import ModelConfig
from birkhoff.interop.hf import import_hf
from birkhoff.interop.hf_config import model_config_from_hf
from birkhoff.runtime.checkpoint import load_checkpoint


def import_and_load(hf_dir: Path, out: Path, **kwargs: int) -> torch.nn.Module:
    import_hf(hf_dir, out, **kwargs)
    return load_checkpoint(out).model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("sharded", [False, True])
def test_logits_match_transformers(case: str, sharded: bool, tmp_path: Path) -> None:
    hf_model = build_hf_model(case)
    save_hf_model(hf_model, tmp_path / "hf", sharded=sharded)
    if sharded:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = import_and_load(tmp_path / "hf", tmp_path / "ckpt")
    ids_BT = torch.randint(
        0, hf_model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ours_BTV = model(ids_BT).logits
    ref_BTV = hf_logits(hf_model, ids_BT)
    assert ref_BTV.abs().max() > 0.1  # a non-trivial reference
    torch.testing.assert_close(ours_BTV, ref_BTV, atol=1e-4, rtol=0)


def test_config_fields_per_family(tmp_path: Path) -> None:
    cfgs = {}
    for case in CASES:
        save_hf_model(build_hf_model(case), tmp_path / case)
        cfgs[case] = model_config_from_hf(json.loads((tmp_path / case / "config.json").read_text()))
    assert cfgs["qwen2-bias"].qkv_bias and not cfgs["qwen2-bias"].attn_out_bias
    assert cfgs["qwen2-bias"].tie_embeddings
    assert cfgs["qwen3-qknorm"].qk_norm and cfgs["qwen3-qknorm"].head_dim == 16
    assert cfgs["qwen3-qknorm"].dim == 32 and cfgs["qwen3-qknorm"].attn_head_dim == 16
    assert cfgs["llama-linear-bias"].qkv_bias and cfgs["llama-linear-bias"].attn_out_bias
    assert cfgs["llama-tied-llama3"].rope_scaling == "llama3"
    assert cfgs["llama-yarn"].rope_attention_factor == pytest.approx(
        0.1 * torch.tensor(4.0).log().item() + 1
    )
    assert cfgs["mistral"].max_seq_len == 64  # capped at the sliding window: exact below it
    assert cfgs["llama-gqa"] == ModelConfig(
        vocab_size=97, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, mlp_hidden=48,
        num_streams=1, mtp_depth=0, max_seq_len=128, rope_theta=500.0, norm_eps=1e-5,
    )  # fmt: skip


BAD_FIELDS = [
    ({"model_type": "gemma"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "longrope"}}, "rope_type"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear"}}, "factor"),
]


@pytest.mark.parametrize(("change", "field"), BAD_FIELDS)
def test_unsupported_options_name_the_field(change: dict, field: str, tmp_path: Path) -> None:
    save_hf_model(build_hf_model("llama-gqa"), tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=field):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_old_rope_layout_is_read() -> None:
    hf = {"model_type": "llama", "vocab_size": 10, "hidden_size": 16, "num_hidden_layers": 1,
          "num_attention_heads": 2, "intermediate_size": 8, "rope_theta": 1234.0,
          "rope_scaling": {"type": "linear", "factor": 3.0}}  # fmt: skip
    cfg = model_config_from_hf(hf)
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor) == (1234.0, "linear", 3.0)


def test_missing_unknown_and_misshaped_tensors_are_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    hf_model = build_hf_model("llama-gqa")
    save_hf_model(hf_model, tmp_path / "hf")
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(file)
    for name, edit in [
        ("model.layers.1.mlp.up_proj.weight", lambda s, n: s.pop(n)),
        ("model.layers.0.mystery.weight", lambda s, n: s.__setitem__(n, torch.zeros(2))),
        ("model.norm.weight", lambda s, n: s.__setitem__(n, torch.ones(7))),
    ]:
        broken = dict(state)
        edit(broken, name)
        save_file(broken, file, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_checkpoint_keeps_dtypes_and_carries_the_hf_files(tmp_path: Path) -> None:
    hf_model = build_hf_model("qwen2-bias").to(torch.bfloat16)
    save_hf_model(hf_model, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"eos_token": "x"}')
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["files"]
    assert {"hf_config.json", "tokenizer_config.json", "generation_config.json"} <= set(manifest)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("embed.weight").dtype == torch.bfloat16
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 (not a mapping); tied: stored once, aliased in meta.json
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.model.lm_head.weight is loaded.model.embed.weight


def test_published_config_layouts() -> None:
    """config.json as Llama 3.2, Qwen2.5 and Mistral 7B v0.1 publish them (pre-5 rope layout)."""
    llama32 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
               "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
               "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
               "hidden_act": "silu", "max_position_embeddings": 131072, "mlp_bias": False,
               "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
               "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               "tie_word_embeddings": True, "torch_dtype": "bfloat16",
               "eos_token_id": [128001, 128008, 128009]}  # fmt: skip
    cfg = model_config_from_hf(llama32, max_seq_len=4096)
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_seq_len) == (
        "llama3",
        32.0,
        8192,
    )
    assert (cfg.rope_theta, cfg.tie_embeddings, cfg.head_dim, cfg.kv_heads) == (5e5, True, 64, 8)
    qwen25 = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
              "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
              "max_window_layers": 21, "rms_norm_eps": 1e-06, "rope_scaling": None,
              "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
              "tie_word_embeddings": True}  # fmt: skip
    cfg = model_config_from_hf(qwen25)
    assert cfg.qkv_bias and not cfg.attn_out_bias and cfg.head_dim == 64
    assert (cfg.rope_scaling, cfg.max_seq_len) == ("none", 32768)
    mistral = {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
               "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 32768,
               "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096}  # fmt: skip
    assert model_config_from_hf(mistral).max_seq_len == 4096
    with pytest.raises(ValueError, match="max_seq_len=8192"):
        model_config_from_hf(mistral, max_seq_len=8192)
