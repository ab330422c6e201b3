"""The engine's inference layout: typed weight records, served names, and the manifest.

Legend: D model dim, H query heads, G kv heads, K head dim, F MLP hidden, V vocab, S streams,
C = S*D, P = S*S+2S, E experts, O query low rank, I indexer heads, R experts per token.

`layout(cfg)` builds the model's weight records once, with a `Slot` at every leaf: the served
name, its trainer parts (concatenated on dim 0: fused q/k/v and gate/up) and how it is served.
The flat views (`engine_parts`, `build_manifest`) and the engine's forward records
(`load_weights`: the same tree with tensors at the leaves) both come from it, so a name is
written once; docs/engine.md lists the names and dtypes (DeepSeek-V4 attention: docs/v4.md,
"Engine"). Left out: sharding across devices.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, NamedTuple, TypeVar, cast

import torch
from torch import Tensor

from birkhoff.config import ModelConfig, V4AttentionConfig
from birkhoff.engine.fp8 import FP8_BLOCK, FP8_DTYPE, SCALE_SUFFIX, scale_shape
from birkhoff.model.moe import is_hash_layer, is_moe_layer

Quantize = Literal["fp8"] | None
Parts = tuple[tuple[str, tuple[int, ...]], ...]  # (trainer name, shape) in concatenation order
# "matmul": fp8 when quantized; "fp32": always fp32 (routing, mHC coefficients); "plain": the
# engine dtype (norms, embeddings, biases); "index": int64, never cast (V4's hash table)
Kind = Literal["matmul", "fp32", "plain", "index"]
T = TypeVar("T")


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


class Slot(NamedTuple):
    """One served tensor: its name, its trainer parts (concatenated on dim 0), its kind."""

    name: str
    parts: Parts
    kind: Kind

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(shape[0] for _, shape in self.parts), *self.parts[0][1][1:])


@dataclass(frozen=True, slots=True)
class Linear(Generic[T]):
    """A projection: its weight (block fp8 codes when `scale_inv` is set) and optional bias."""

    weight: T
    bias: T | None = None
    scale_inv: T | None = None  # served only: the weight's fp8 block scales


@dataclass(frozen=True, slots=True)
class HyperWeights(Generic[T]):
    """An mHC connection (P = S*S+2S rows, 3 alphas) or a stream contraction (S rows, 1)."""

    phi: T  # [P, C] or [S, C]
    alpha: T
    bias: T


@dataclass(frozen=True, slots=True)
class AttentionWeights(Generic[T]):
    qkv: Linear[T]  # [H*K + 2*G*K, D]
    o: Linear[T]  # [D, H*K]
    q_norm: T | None  # [K], Qwen3's per-head norms
    k_norm: T | None


@dataclass(frozen=True, slots=True)
class CompressorWeights(Generic[T]):
    """A V4 compressor: kv and gate projections fused on dim 0 ([2 * width, D]; width K, or 2K for
    the overlapping windows of CSA), the gate bias per window slot [ratio, width], the entry
    norm [K]."""

    kv_gate: Linear[T]
    position_bias: T
    norm: T


@dataclass(frozen=True, slots=True)
class IndexerWeights(Generic[T]):
    """CSA's lightning indexer: its own compressor, query projection [I*K, O], head weights
    [I, D]."""

    compressor: CompressorWeights[T]
    q_b: Linear[T]
    weights_proj: Linear[T]


@dataclass(frozen=True, slots=True)
class V4AttentionWeights(Generic[T]):
    """DeepSeek-V4 attention (model/v4_attention.py): q_a_proj and kv_proj fused on dim 0."""

    q_a_kv: Linear[T]  # [O + K, D]
    q_a_norm: T  # [O]
    q_b: Linear[T]  # [H*K, O]
    kv_norm: T  # [K]
    o_a: Linear[T]  # [groups * rank, H*K / groups], one block per head group
    o_b: Linear[T]  # [D, groups * rank]
    sinks: T  # [H]
    compressor: CompressorWeights[T] | None  # CSA and HCA layers
    indexer: IndexerWeights[T] | None  # CSA layers


@dataclass(frozen=True, slots=True)
class DenseWeights(Generic[T]):
    gate_up: Linear[T]  # [2F, D]
    down: Linear[T]  # [D, F]


@dataclass(frozen=True, slots=True)
class MoEWeights(Generic[T]):
    """Router (fp32), stacked experts [E, 2F, D] / [E, D, F], optional shared experts; top-k
    layers select with `router_bias`, V4's hash layers take the experts of `tid2eid` [V, R]."""

    router: T
    router_bias: T | None
    experts_gate_up: Linear[T]
    experts_down: Linear[T]
    shared_gate_up: Linear[T] | None
    shared_down: Linear[T] | None
    tid2eid: T | None = None


@dataclass(frozen=True, slots=True)
class BlockWeights(Generic[T]):
    attn_norm: T
    attn: AttentionWeights[T] | V4AttentionWeights[T]
    hc_attn: HyperWeights[T] | None  # None: S = 1, the plain residual
    mlp_norm: T
    mlp: DenseWeights[T] | MoEWeights[T]
    hc_mlp: HyperWeights[T] | None


@dataclass(frozen=True, slots=True)
class HeadWeights(Generic[T]):
    """The output contraction of the streams (None for S = 1) and the final norm."""

    contraction: HyperWeights[T] | None
    norm: T


@dataclass(frozen=True, slots=True)
class DepthWeights(Generic[T]):
    """One MTP depth: the merge's norms and projection, its block, its own head."""

    hidden_norm: T
    embed_norm: T
    proj: Linear[T]  # [D, 2D]
    block: BlockWeights[T]
    head: HeadWeights[T]


@dataclass(frozen=True, slots=True)
class ModelWeights(Generic[T]):
    embed: T
    layers: tuple[BlockWeights[T], ...]
    head: HeadWeights[T]
    lm_head: Linear[T]  # tied embeddings: the embedding's slot
    mtp: tuple[DepthWeights[T], ...]


Weights = ModelWeights[Tensor]  # what the engine's forward reads


def _one(name: str, *shape: int, kind: Kind = "plain") -> Slot:
    return Slot(name, ((name, shape),), kind)


def _linear(name: str, *shape: int, bias: Slot | None = None) -> Linear[Slot]:
    return Linear(_one(name, *shape, kind="matmul"), bias)


def _hyper(prefix: str, cfg: ModelConfig, *, contraction: bool) -> HyperWeights[Slot] | None:
    """An mHC connection's (or output contraction's) coefficients; none for S = 1."""
    S, C = cfg.num_streams, cfg.num_streams * cfg.dim
    if S == 1:
        return None
    P, num_alpha = (S, 1) if contraction else (S * S + 2 * S, 3)
    return HyperWeights(
        phi=_one(prefix + "phi", P, C, kind="fp32"),
        alpha=_one(prefix + "alpha", num_alpha, kind="fp32"),
        bias=_one(prefix + "bias", P, kind="fp32"),
    )


def _attention(attn: str, cfg: ModelConfig) -> AttentionWeights[Slot]:
    """Fused q/k/v (and bias), o (and the Llama o bias), Qwen3's q/k norms."""
    D, H, G, K = cfg.dim, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    widths = {"wq": H * K, "wk": G * K, "wv": G * K}
    qkv = tuple((f"{attn}{p}.weight", (n, D)) for p, n in widths.items())
    qkv_bias = tuple((f"{attn}{p}.bias", (n,)) for p, n in widths.items())
    o_bias = _one(attn + "wo.bias", D) if cfg.attn_out_bias else None
    return AttentionWeights(
        qkv=Linear(
            Slot(attn + "wqkv.weight", qkv, "matmul"),
            Slot(attn + "wqkv.bias", qkv_bias, "plain") if cfg.qkv_bias else None,
        ),
        o=_linear(attn + "wo.weight", D, H * K, bias=o_bias),
        q_norm=_one(attn + "q_norm.weight", K) if cfg.qk_norm else None,
        k_norm=_one(attn + "k_norm.weight", K) if cfg.qk_norm else None,
    )


def _moe(mlp: str, cfg: ModelConfig, index: int) -> MoEWeights[Slot]:
    """An MoE feed-forward's router, stacked experts and shared experts (trainer layout)."""
    assert cfg.moe is not None
    D, E, F = cfg.dim, cfg.moe.num_experts, cfg.moe.expert_hidden
    shared = cfg.moe.num_shared_experts * F  # F' of the shared experts' one SwiGLU
    hashed = is_hash_layer(cfg, index)
    R = cfg.moe.experts_per_token
    return MoEWeights(
        router=_one(mlp + "router.weight", E, D, kind="fp32"),
        router_bias=None if hashed else _one(mlp + "router_bias", E, kind="fp32"),
        experts_gate_up=_linear(mlp + "experts.w_gate_up", E, 2 * F, D),
        experts_down=_linear(mlp + "experts.w_down", E, D, F),
        shared_gate_up=_linear(mlp + "shared.w_gate_up", 2 * shared, D) if shared else None,
        shared_down=_linear(mlp + "shared.w_down", D, shared) if shared else None,
        tid2eid=_one(mlp + "tid2eid", cfg.vocab_size, R, kind="index") if hashed else None,
    )


def _compressor(p: str, dim: int, K: int, ratio: int, *, overlap: bool) -> CompressorWeights[Slot]:
    """A compressor's records under prefix `p`; its projections stay in the engine dtype (V4's
    checkpoints keep them out of fp8)."""
    W = 2 * K if overlap else K
    kv_gate = ((p + "kv_proj.weight", (W, dim)), (p + "gate_proj.weight", (W, dim)))
    return CompressorWeights(
        kv_gate=Linear(Slot(p + "kv_gate.weight", kv_gate, "plain")),
        position_bias=_one(p + "position_bias", ratio, W),
        norm=_one(p + "kv_norm.weight", K),
    )


def _indexer(p: str, cfg: ModelConfig, v4: V4AttentionConfig) -> IndexerWeights[Slot]:
    K, heads = v4.index_head_dim, v4.index_n_heads
    return IndexerWeights(
        compressor=_compressor(p, cfg.dim, K, v4.compress_rate_csa, overlap=True),
        q_b=Linear(_one(p + "q_b_proj.weight", heads * K, v4.q_lora_rank)),
        weights_proj=Linear(_one(p + "scorer.weights_proj.weight", heads, cfg.dim)),
    )


def _v4(prefix: str, cfg: ModelConfig, index: int) -> V4AttentionWeights[Slot]:
    """Block `index`'s V4 attention; the compressor and indexer of its layer kind."""
    v4, a = cfg.attention, prefix + "attn."
    assert isinstance(v4, V4AttentionConfig)
    D, H, K, rank_q = cfg.dim, cfg.num_heads, v4.head_dim, v4.q_lora_rank
    kind, c = v4.layer_type(index), a + "compressor."
    q_a_kv = ((a + "q_a_proj.weight", (rank_q, D)), (a + "kv_proj.weight", (K, D)))
    compressor = indexer = None
    if kind == "compressed_sparse_attention":
        compressor = _compressor(c, D, K, v4.compress_rate_csa, overlap=True)
        indexer = _indexer(c + "indexer.", cfg, v4)
    elif kind == "heavily_compressed_attention":
        compressor = _compressor(c, D, K, v4.compress_rate_hca, overlap=False)
    rank = v4.o_groups * v4.o_lora_rank
    return V4AttentionWeights(
        q_a_kv=Linear(Slot(a + "q_a_kv.weight", q_a_kv, "matmul")),
        q_a_norm=_one(a + "q_a_norm.weight", rank_q),
        q_b=_linear(a + "q_b_proj.weight", H * K, rank_q),
        kv_norm=_one(a + "kv_norm.weight", K),
        o_a=_linear(a + "o_a_proj.weight", rank, H * K // v4.o_groups),
        o_b=_linear(a + "o_b_proj.weight", D, rank),
        sinks=_one(a + "sinks", H),
        compressor=compressor,
        indexer=indexer,
    )


def _dense(mlp: str, cfg: ModelConfig) -> DenseWeights[Slot]:
    D, F = cfg.dim, cfg.ffn_dim
    gate_up = ((mlp + "w_gate.weight", (F, D)), (mlp + "w_up.weight", (F, D)))
    return DenseWeights(
        Linear(Slot(mlp + "w_gate_up.weight", gate_up, "matmul")),
        _linear(mlp + "w_down.weight", D, F),
    )


def _block(prefix: str, cfg: ModelConfig, index: int) -> BlockWeights[Slot]:
    """Block `index` (0..L-1 main layers, L + k for MTP depth k)."""
    mlp = prefix + "mlp."
    return BlockWeights(
        attn_norm=_one(prefix + "attn_norm.weight", cfg.dim),
        attn=_v4(prefix, cfg, index) if cfg.attention else _attention(prefix + "attn.", cfg),
        hc_attn=_hyper(prefix + "hc_attn.", cfg, contraction=False),
        mlp_norm=_one(prefix + "mlp_norm.weight", cfg.dim),
        mlp=_moe(mlp, cfg, index) if is_moe_layer(cfg, index) else _dense(mlp, cfg),
        hc_mlp=_hyper(prefix + "hc_mlp.", cfg, contraction=False),
    )


def _head(prefix: str, cfg: ModelConfig) -> HeadWeights[Slot]:
    contraction = _hyper(prefix + "contraction.", cfg, contraction=True)
    return HeadWeights(contraction, _one(prefix + "norm.weight", cfg.dim))


def _depth(k: int, cfg: ModelConfig) -> DepthWeights[Slot]:
    p, D = f"mtp.{k}.", cfg.dim
    return DepthWeights(
        hidden_norm=_one(p + "hidden_norm.weight", D),
        embed_norm=_one(p + "embed_norm.weight", D),
        proj=_linear(p + "proj.weight", D, 2 * D),
        block=_block(p + "block.", cfg, cfg.num_layers + k),
        head=_head(p, cfg),
    )


@functools.cache
def layout(cfg: ModelConfig) -> ModelWeights[Slot]:
    """The weight records of `cfg`'s model with a Slot (name, trainer parts, kind) per leaf."""
    V, D = cfg.vocab_size, cfg.dim
    embed = _one("embed.weight", V, D)
    return ModelWeights(
        embed=embed,
        layers=tuple(_block(f"layers.{i}.", cfg, i) for i in range(cfg.num_layers)),
        head=_head("", cfg),
        lm_head=Linear(embed) if cfg.tie_embeddings else _linear("lm_head.weight", V, D),
        mtp=tuple(_depth(k, cfg) for k in range(cfg.mtp_depth)),
    )


def leaves(node: Any) -> Iterator[Any]:
    """Every leaf of a record tree in field order (a tied tensor as often as it is used)."""
    if node is None:
        return
    if isinstance(node, tuple) and not isinstance(node, Slot):
        for child in node:
            yield from leaves(child)
    elif dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            yield from leaves(getattr(node, f.name))
    else:
        yield node


def slots(cfg: ModelConfig) -> dict[str, Slot]:
    """Engine name -> Slot of every served tensor (before quantization), in layout order."""
    return {s.name: s for s in leaves(layout(cfg))}


def engine_parts(cfg: ModelConfig) -> dict[str, Parts]:
    """Engine name -> its trainer parts (name, shape); the engine tensor is cat(parts, dim=0)."""
    return {name: s.parts for name, s in slots(cfg).items()}


def engine_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the engine serves (before quantization)."""
    return {name: s.shape for name, s in slots(cfg).items()}


def matmul_weights(cfg: ModelConfig) -> frozenset[str]:
    """The served matmul weights: block fp8 when the engine quantizes."""
    return frozenset(name for name, s in slots(cfg).items() if s.kind == "matmul")


KIND_DTYPES = {"fp32": torch.float32, "index": torch.int64}  # the rest: the engine dtype


def build_manifest(
    cfg: ModelConfig, *, dtype: torch.dtype, quantize: Quantize
) -> dict[str, TensorSpec]:
    """Name -> TensorSpec of every tensor the engine serves (main model and MTP drafter)."""
    manifest: dict[str, TensorSpec] = {}
    for name, s in slots(cfg).items():
        if quantize == "fp8" and s.kind == "matmul":
            manifest[name] = TensorSpec(s.shape, FP8_DTYPE)
            scales = scale_shape(s.shape, FP8_BLOCK)
            manifest[name + SCALE_SUFFIX] = TensorSpec(scales, torch.float32)
        else:
            manifest[name] = TensorSpec(s.shape, KIND_DTYPES.get(s.kind, dtype))
    return manifest


def _load(node: Any, weights: Mapping[str, Tensor]) -> Any:
    if node is None:
        return None
    if isinstance(node, Slot):
        return weights[node.name]
    if isinstance(node, Linear):
        scale_inv = weights.get(node.weight.name + SCALE_SUFFIX)
        return Linear(_load(node.weight, weights), _load(node.bias, weights), scale_inv)
    if isinstance(node, tuple):
        return tuple(_load(child, weights) for child in node)
    values = {f.name: _load(getattr(node, f.name), weights) for f in dataclasses.fields(node)}
    return type(node)(**values)


def load_weights(cfg: ModelConfig, weights: Mapping[str, Tensor]) -> Weights:
    """The forward's records of served tensors `weights` (name -> tensor, the manifest's)."""
    return cast(Weights, _load(layout(cfg), weights))


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
