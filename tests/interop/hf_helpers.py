"""Tiny random HuggingFace Llama-family models built locally (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

transformers = __import__("pytest").importorskip("transformers")

BASE: dict[str, Any] = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-5, rope_theta=500.0,
)  # fmt: skip

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", {}),
    "llama-tied-llama3": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling=dict(
        rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "llama-linear-bias": ("LlamaConfig", dict(attention_bias=True, rope_scaling=dict(
        rope_type="linear", factor=2.0))),
    "llama-yarn": ("LlamaConfig", dict(rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32))),
    "mistral": ("MistralConfig", dict(sliding_window=64, num_key_value_heads=1)),
    "qwen2-bias": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3Config", dict(head_dim=16)),  # head_dim * heads != hidden_size
}  # fmt: skip


def build_hf_model(case: str, *, seed: int = 0, **overrides: Any) -> Any:
    """A tiny random model of one CASES entry, every parameter (biases, norms) non-trivial."""
    config_cls, extra = CASES[case]
    kwargs = {**BASE, **extra, **overrides}
    if "rope_scaling" in kwargs:
        kwargs["rope_parameters"] = {"rope_theta": kwargs.pop("rope_theta"),
                                     **kwargs.pop("rope_scaling")}  # fmt: skip
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    return model.float().eval()


def save_hf_model(model: Any, path: Path, *, sharded: bool = False) -> Path:
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "1GB")
    return path


def hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits
