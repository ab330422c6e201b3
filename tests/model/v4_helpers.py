"""Tiny random DeepSeek-V4 models built locally with transformers (nothing is downloaded), the
matching birkhoff config, the weight copy, and the reference run in fp64.

transformers' V4 pins its norms, rope, softmaxes and mHC to fp32 (`.float()`, `torch.float32`)
whatever the model's dtype. `reference_fp64()` runs that code as written with fp32 read as
fp64 (the module's `torch` seen through a proxy whose float32 is float64; `Tensor.float`
leaving fp64 tensors as they are), so an fp64 comparison compares the same math in fp64.
With `moe=False` the reference's MoE is replaced by a dense V4 MLP (its shared-expert SwiGLU,
the clamp limit far away); with `moe=True` it keeps V4's MoE (a hash layer, then top-k layers).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from birkhoff.config import ModelConfig, MoEConfig, V4AttentionConfig
from birkhoff.interop.v4_names import hf_parts
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


def build_reference(
    *, seed: int = 0, dtype: torch.dtype = torch.float64, moe: bool = False, **overrides: Any
) -> Any:
    """A tiny random DeepseekV4ForCausalLM, every parameter non-trivial (dense MLPs unless
    `moe`: then layer 0 hash-routed, the others top-k, the expert clamp active)."""
    if moe:
        overrides = dict(mlp_layer_types=["hash_moe", "moe", "moe"], swiglu_limit=1.5) | overrides
    config = transformers.DeepseekV4Config(**{**BASE, **overrides})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the loop over experts (fp64 on CPU)
    torch.manual_seed(seed)
    with reference_fp64():  # rope inverse frequencies computed in fp64
        model = transformers.DeepseekV4ForCausalLM(config)
    for layer in model.model.layers:
        if moe:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                pick = [
                    torch.randperm(config.n_routed_experts)[:2] for _ in range(BASE["vocab_size"])
                ]
                gate.tid2eid.copy_(torch.stack(pick))
            else:
                gate.e_score_correction_bias.normal_(0.0, 0.3)
        else:
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


def birkhoff_moe(config: Any) -> MoEConfig:
    """V4's MoE as birkhoff's MoEConfig."""
    return MoEConfig(
        num_experts=config.n_routed_experts, experts_per_token=config.num_experts_per_tok,
        expert_hidden=config.moe_intermediate_size, num_shared_experts=1, num_dense_layers=0,
        num_hash_layers=config.mlp_layer_types.count("hash_moe"),
        route_scale=config.routed_scaling_factor, scoring=config.scoring_func,
        swiglu_limit=config.swiglu_limit,
    )  # fmt: skip


def birkhoff_config(config: Any, *, moe: bool) -> ModelConfig:
    """The birkhoff config of a transformers DeepseekV4Config (no MTP; dense unless `moe`)."""
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
        moe=birkhoff_moe(config) if moe else None,
    )  # fmt: skip


DENSE = {  # birkhoff -> the dense stand-in's names (V4 itself has no dense MLP)
    "mlp.w_gate.weight": "mlp.inner.gate_proj.weight",
    "mlp.w_up.weight": "mlp.inner.up_proj.weight",
    "mlp.w_down.weight": "mlp.inner.down_proj.weight",
}


def reference_names(name: str) -> tuple[str, ...]:
    """transformers' tensors of birkhoff tensor `name` (interop/v4_names.py, the import's map),
    concatenated along dim 0 where there are two (the shared expert's gate and up)."""
    parts = hf_parts(name)
    if parts is not None:
        assert parts.dim == 0 or len(parts.names) == 1
        return parts.names
    head, _, rest = name.partition(".")
    index, _, rest = rest.partition(".")
    return (f"model.layers.{index}.{DENSE[rest]}",)


def build_pair(
    *, seed: int = 0, dtype: torch.dtype = torch.float64, moe: bool = False, **overrides: Any
) -> Any:
    """(reference, birkhoff Transformer with the same weights, birkhoff name -> ref names)."""
    reference = build_reference(seed=seed, dtype=dtype, moe=moe, **overrides)
    model = Transformer(birkhoff_config(reference.config, moe=moe)).to(dtype)
    theirs = reference.state_dict()
    names = {name: reference_names(name) for name in model.state_dict()}
    assert {n for ns in names.values() for n in ns} == set(theirs)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(torch.cat([theirs[n] for n in names[name]]))
    return reference, model, names


def reference_logits(reference: Any, ids: torch.Tensor) -> torch.Tensor:
    """The reference's logits; fp64 models run under `reference_fp64`."""
    if next(reference.parameters()).dtype != torch.float64:
        return reference(input_ids=ids).logits
    with reference_fp64():
        return reference(input_ids=ids).logits
