"""Tiny random DeepSeek-V4 models built locally with transformers (nothing is downloaded), the
matching birkhoff config, the weight copy, and the reference run in fp64.

transformers' V4 pins its norms, rope, softmaxes and mHC to fp32 (`.float()`, `torch.float32`)
whatever the model's dtype. `reference_fp64()` runs that code as written with fp32 read as
fp64 (the module's `torch` seen through a proxy whose float32 is float64; `Tensor.float`
leaving fp64 tensors as they are), so an fp64 comparison compares the same math in fp64.
The reference's MoE is replaced by a dense V4 MLP (its shared-expert SwiGLU, the clamp limit
far away), the feed-forward birkhoff's V4 blocks have until the V4 MoE lands.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from birkhoff.config import ModelConfig, V4AttentionConfig
from birkhoff.model.transformer import Transformer

transformers = __import__("pytest").importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ref  # noqa: E402

KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
BASE: dict[str, Any] = dict(
    vocab_size=61, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, q_lora_rank=12, partial_rotary_factor=0.5,
    layer_types=list(KINDS), mlp_layer_types=["moe"] * 3,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=6, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=12,
    index_topk=3, hc_mult=4, moe_intermediate_size=24, n_routed_experts=4,
    num_experts_per_tok=2, swiglu_limit=1e9, rope_theta=500.0, compress_rope_theta=4000.0,
    max_position_embeddings=64, rms_norm_eps=1e-6, hc_eps=1e-6,
)  # fmt: skip


class _Fp64Torch:
    """`torch` with float32 (and torch.float) read as float64."""

    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextmanager
def reference_fp64() -> Iterator[None]:
    """Inside, transformers' V4 code computes in fp64 where it pins fp32 (see module doc)."""
    to_float = torch.Tensor.float

    def float_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    ref.torch, torch.Tensor.float = _Fp64Torch(), float_  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        ref.torch, torch.Tensor.float = torch, to_float  # type: ignore[method-assign]


class DenseMLP(nn.Module):
    """The reference's V4 MLP in place of its MoE block (which also receives input_ids)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.inner = ref.DeepseekV4MLP(config)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner(x)


def build_reference(*, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: Any) -> Any:
    """A tiny random DeepseekV4ForCausalLM (dense MLPs), every parameter non-trivial."""
    config = transformers.DeepseekV4Config(**{**BASE, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    with reference_fp64():  # rope inverse frequencies computed in fp64
        model = transformers.DeepseekV4ForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp = DenseMLP(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
            elif name.endswith(("norm.weight", "layernorm.weight", "scale")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:  # sinks, HC biases, compressor position biases
                param.normal_(0.0, 0.5)
    return model.to(dtype).eval()


def birkhoff_config(config: Any) -> ModelConfig:
    """The birkhoff config of a transformers DeepseekV4Config (dense feed-forward, no MTP)."""
    attention = V4AttentionConfig(
        q_lora_rank=config.q_lora_rank, head_dim=config.head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, layer_types=tuple(config.layer_types),
        sliding_window=config.sliding_window,
        compress_rate_csa=config.compress_rates["compressed_sparse_attention"],
        compress_rate_hca=config.compress_rates["heavily_compressed_attention"],
        compress_rope_theta=float(config.compress_rope_theta),
        index_n_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
        index_topk=config.index_topk, o_groups=config.o_groups, o_lora_rank=config.o_lora_rank,
    )  # fmt: skip
    return ModelConfig(
        vocab_size=config.vocab_size, dim=config.hidden_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=1, mlp_hidden=config.moe_intermediate_size, num_streams=config.hc_mult,
        sinkhorn_iters=config.hc_sinkhorn_iters, mhc_eps=config.hc_eps, mtp_depth=0,
        max_seq_len=config.max_position_embeddings, rope_theta=float(config.rope_theta),
        norm_eps=config.rms_norm_eps, attention=attention,
    )  # fmt: skip


RENAMES = (  # transformers' name piece -> birkhoff's, applied in order
    ("model.embed_tokens.", "embed."), ("model.layers.", "layers."), ("model.norm.", "norm."),
    ("model.hc_head.hc_fn", "contraction.phi"), ("model.hc_head.hc_base", "contraction.bias"),
    ("model.hc_head.hc_scale", "contraction.alpha"), (".self_attn.", ".attn."),
    (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".mlp_norm."),
    (".attn_hc.", ".hc_attn."), (".ffn_hc.", ".hc_mlp."),
    (".mlp.inner.gate_proj.", ".mlp.w_gate."), (".mlp.inner.up_proj.", ".mlp.w_up."),
    (".mlp.inner.down_proj.", ".mlp.w_down."),
)  # fmt: skip
HC_PARAMS = {"fn": "phi", "base": "bias", "scale": "alpha"}


def birkhoff_name(name: str) -> str:
    for old, new in RENAMES:
        name = name.replace(old, new)
    head, _, leaf = name.rpartition(".")
    if head.endswith(("hc_attn", "hc_mlp")):
        leaf = HC_PARAMS[leaf]
    return f"{head}.{leaf}"


def build_pair(*, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides: Any) -> Any:
    """(reference, birkhoff Transformer with the same weights, name map birkhoff -> ref)."""
    reference = build_reference(seed=seed, dtype=dtype, **overrides)
    model = Transformer(birkhoff_config(reference.config)).to(dtype)
    names = {birkhoff_name(n): n for n, _ in reference.named_parameters()}
    ours = dict(model.named_parameters())
    assert set(names) == set(ours), set(names) ^ set(ours)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            ours[birkhoff_name(name)].copy_(param)
    return reference, model, names


def reference_logits(reference: Any, ids: torch.Tensor) -> torch.Tensor:
    """The reference's logits; fp64 models run under `reference_fp64`."""
    if next(reference.parameters()).dtype != torch.float64:
        return reference(input_ids=ids).logits
    with reference_fp64():
        return reference(input_ids=ids).logits
