"""The engine's inference layout: served names, fusions, shapes, and the manifest.

Legend: D model dim, H query heads, G kv heads, K head dim, F MLP hidden, V vocab, S streams,
C = S*D, P = S*S+2S, E experts.

The engine serves fused projections: `attn.wqkv.weight` = cat(wq, wk, wv) and
`mlp.w_gate_up.weight` = cat(w_gate, w_up) along the output dim (dim 0); with `qkv_bias` the
biases fuse the same way into `attn.wqkv.bias`. Every other tensor keeps its trainer name (the
o bias `attn.wo.bias`, the q/k norms `attn.q_norm.weight`, `attn.k_norm.weight`). An MoE
feed-forward (model/moe.py) is served as the trainer stores it: `mlp.router.weight` [E, D] and
`mlp.router_bias` [E] (both fp32 whatever the engine dtype: routing is a discrete choice, and
bias steps of 1e-3 vanish in bf16), the stacked experts `mlp.experts.w_gate_up` [E, 2F, D] and
`mlp.experts.w_down` [E, D, F], and the shared experts `mlp.shared.w_gate_up` [2F', D],
`mlp.shared.w_down` [D, F'] (F' = shared experts * F). With tied embeddings the engine serves
`embed.weight` once and uses it as the lm_head. The MTP drafter (`mtp.{k}.*`) is laid out
exactly like the main model.

`engine_parts(cfg)` is the whole layout: engine name -> its trainer parts (name, shape) in
concatenation order, computed from the ModelConfig alone (tests/engine/test_layout.py checks it
against the trainer's parameters). The manifest adds each served tensor's dtype: with
`quantize="fp8"` exactly the matmul weights are float8_e4m3fn plus `name + "_scale_inv"` (fp32,
one scale per 128x128 block, per expert for a stack, engine/fp8.py); biases, norms and
embeddings (also when tied to the lm_head) stay in the engine dtype; router tensors and the mHC
coefficient tensors (phi, alpha, bias) are fp32 in every engine: the coefficients are computed
in fp32 from fp32 parameters in the trainer, and the fused kernels read them as fp32 (a bf16
copy would cost two cast kernels per sublayer and decode step, and precision).

`trainer_tensors` looks a model's Parameters (and buffers: the router bias) up by name, every
time it is called, so a caller always reads the current ones (also after `p.data = t` or a
replaced module).
Left out: per-channel scales, int8/int4, sharding across devices.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.fp8 import FP8_BLOCK, FP8_DTYPE, SCALE_SUFFIX, scale_shape
from birkhoff.model.moe import is_moe_layer

Quantize = Literal["fp8"] | None
Parts = tuple[tuple[str, tuple[int, ...]], ...]  # (trainer name, shape) in concatenation order

# always fp32: MoE routing decisions, and the mHC coefficient tensors (phi, alpha, bias of every
# hyper-connection and stream contraction), which the trainer and the fused kernels use in fp32
MHC_COEFFICIENTS = tuple(
    f"{where}.{t}"
    for where in ("hc_attn", "hc_mlp", "contraction")
    for t in ("phi", "alpha", "bias")
)
FP32_SUFFIXES = ("mlp.router.weight", "mlp.router_bias", *MHC_COEFFICIENTS)
# engine tensors that are matmul weights (candidates for fp8); never norms, embeddings, mHC
MATMUL_SUFFIXES = (
    "attn.wqkv.weight",
    "attn.wo.weight",
    "mlp.w_gate_up.weight",
    "mlp.w_down.weight",
    "mlp.experts.w_gate_up",
    "mlp.experts.w_down",
    "mlp.shared.w_gate_up",
    "mlp.shared.w_down",
    "proj.weight",
    "lm_head.weight",
)


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def is_matmul_weight(engine_name: str) -> bool:
    return engine_name.endswith(MATMUL_SUFFIXES)


def _one(name: str, *shape: int) -> tuple[str, Parts]:
    return name, ((name, shape),)


def _hyper(prefix: str, cfg: ModelConfig, *, contraction: bool) -> list[tuple[str, Parts]]:
    """An mHC connection's (or output contraction's) coefficients; none for S = 1."""
    S, C = cfg.num_streams, cfg.num_streams * cfg.dim
    if S == 1:
        return []
    P, num_alpha = (S, 1) if contraction else (S * S + 2 * S, 3)
    return [_one(prefix + "phi", P, C), _one(prefix + "alpha", num_alpha), _one(prefix + "bias", P)]


def _moe(mlp: str, cfg: ModelConfig) -> list[tuple[str, Parts]]:
    """An MoE feed-forward's router, stacked experts and shared experts (trainer layout)."""
    assert cfg.moe is not None
    D, E, F = cfg.dim, cfg.moe.num_experts, cfg.moe.expert_hidden
    out = [
        _one(mlp + "router.weight", E, D),
        _one(mlp + "router_bias", E),
        _one(mlp + "experts.w_gate_up", E, 2 * F, D),
        _one(mlp + "experts.w_down", E, D, F),
    ]
    shared = cfg.moe.num_shared_experts * F  # F' of the shared experts' one SwiGLU
    if shared:
        out += [
            _one(mlp + "shared.w_gate_up", 2 * shared, D),
            _one(mlp + "shared.w_down", D, shared),
        ]
    return out


def _block(prefix: str, cfg: ModelConfig, index: int) -> list[tuple[str, Parts]]:
    """Block `index` (0..L-1 main layers, L + k for MTP depth k)."""
    D, H, G, K, F = cfg.dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_dim
    attn, mlp = prefix + "attn.", prefix + "mlp."
    qkv = ((attn + "wq.weight", (H * K, D)), (attn + "wk.weight", (G * K, D)),
           (attn + "wv.weight", (G * K, D)))  # fmt: skip
    gate_up = ((mlp + "w_gate.weight", (F, D)), (mlp + "w_up.weight", (F, D)))
    dense = [(mlp + "w_gate_up.weight", gate_up), _one(mlp + "w_down.weight", D, F)]
    return [
        _one(prefix + "attn_norm.weight", D),
        (attn + "wqkv.weight", qkv),
        *_attn_options(attn, cfg),
        _one(attn + "wo.weight", D, H * K),
        *_hyper(prefix + "hc_attn.", cfg, contraction=False),
        _one(prefix + "mlp_norm.weight", D),
        *(_moe(mlp, cfg) if is_moe_layer(cfg, index) else dense),
        *_hyper(prefix + "hc_mlp.", cfg, contraction=False),
    ]


def _attn_options(attn: str, cfg: ModelConfig) -> list[tuple[str, Parts]]:
    """The Llama-family attention extras: fused q/k/v bias, o bias, q/k norm weights."""
    D, H, G, K = cfg.dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    out: list[tuple[str, Parts]] = []
    if cfg.qkv_bias:
        parts = ((attn + "wq.bias", (H * K,)), (attn + "wk.bias", (G * K,)),
                 (attn + "wv.bias", (G * K,)))  # fmt: skip
        out.append((attn + "wqkv.bias", parts))
    if cfg.attn_out_bias:
        out.append(_one(attn + "wo.bias", D))
    if cfg.qk_norm:
        out += [_one(attn + "q_norm.weight", K), _one(attn + "k_norm.weight", K)]
    return out


@functools.cache
def engine_parts(cfg: ModelConfig) -> dict[str, Parts]:
    """Engine name -> its trainer parts (name, shape); the engine tensor is cat(parts, dim=0)."""
    D, V = cfg.dim, cfg.vocab_size
    out = [_one("embed.weight", V, D)]
    for i in range(cfg.num_layers):
        out += _block(f"layers.{i}.", cfg, i)
    out += [*_hyper("contraction.", cfg, contraction=True), _one("norm.weight", D)]
    if not cfg.tie_embeddings:
        out.append(_one("lm_head.weight", V, D))
    for k in range(cfg.mtp_depth):
        p = f"mtp.{k}."
        out += [_one(p + "hidden_norm.weight", D), _one(p + "embed_norm.weight", D),
                _one(p + "proj.weight", D, 2 * D), *_block(p + "block.", cfg, cfg.num_layers + k),
                *_hyper(p + "contraction.", cfg, contraction=True),
                _one(p + "norm.weight", D)]  # fmt: skip
    return dict(out)


def engine_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the engine serves (before quantization)."""
    return {
        name: (sum(shape[0] for _, shape in parts), *parts[0][1][1:])
        for name, parts in engine_parts(cfg).items()
    }


def build_manifest(
    cfg: ModelConfig, *, dtype: torch.dtype, quantize: Quantize
) -> dict[str, TensorSpec]:
    """Name -> TensorSpec of every tensor the engine serves (main model and MTP drafter)."""
    manifest: dict[str, TensorSpec] = {}
    for name, shape in engine_shapes(cfg).items():
        if quantize == "fp8" and is_matmul_weight(name):
            manifest[name] = TensorSpec(shape, FP8_DTYPE)
            manifest[name + SCALE_SUFFIX] = TensorSpec(scale_shape(shape, FP8_BLOCK), torch.float32)
        elif name.endswith(FP32_SUFFIXES):
            manifest[name] = TensorSpec(shape, torch.float32)
        else:
            manifest[name] = TensorSpec(shape, dtype)
    return manifest


class SourceError(ValueError):
    """A model lacks trainer tensors the engine serves, or holds them with other shapes."""

    def __init__(self, missing: list[str], mismatched: dict[str, str]) -> None:
        self.missing, self.mismatched = missing, mismatched
        super().__init__(f"trainer tensors missing: {missing}; mis-shaped: {mismatched}")


def trainer_tensors(
    model: torch.nn.Module, names: Sequence[str], shapes: Sequence[tuple[int, ...]]
) -> list[Tensor]:
    """The model's current Parameters (or buffers) `names`, looked up by name on every call (none
    can be stale); raises SourceError naming every one the model lacks or mis-shapes."""
    params = dict(model.named_buffers())  # the MoE router bias is a buffer
    params.update(model.named_parameters(remove_duplicate=False))
    found = [params.get(name) for name in names]
    if [None if p is None else p.shape for p in found] == list(shapes):
        return found  # type: ignore[return-value]
    missing = [n for n, p in zip(names, found, strict=True) if p is None]
    mismatched = {
        n: f"shape {list(p.shape)}, expected {list(shape)}"
        for n, p, shape in zip(names, found, shapes, strict=True)
        if p is not None and p.shape != shape
    }
    raise SourceError(missing, mismatched)
