"""Frozen per-component configs.

Every config is a frozen, slotted, keyword-only dataclass. Invalid values raise `ValueError`
naming the field and the value at construction, so a bad config never reaches the model.
Derived quantities are properties (`head_dim`, `kv_heads`, `ffn_dim`), not stored fields, so a
config round-trips through JSON with exactly the fields a user wrote.
Whole-run configs (training, RL) live next to the code that consumes them; presets.py combines
them into named presets.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

# which ops run as fused Triton kernels (`birkhoff.kernels.use_fused`): a runtime option of the
# trainer (`TrainConfig.kernels`) and of the engine (`Engine(kernels=...)`), never of the network
Kernels = Literal["auto", "eager", "triton"]
KERNELS: tuple[Kernels, ...] = ("auto", "eager", "triton")
# fields older checkpoints' model configs may hold, dropped on load
RETIRED_MODEL_FIELDS = ("mhc_kernels",)


def check(cond: bool, field: str, value: object, why: str) -> None:
    """Raise a ValueError naming `field` and `value` unless `cond` holds."""
    if not cond:
        raise ValueError(f"{field}={value!r} is invalid: {why}")


def reject_unknown_fields(cls: type, data: dict[str, Any]) -> None:
    """Raise a ValueError naming the keys of `data` that are not fields of dataclass `cls`."""
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape and numerics of an mHC + MTP decoder-only transformer."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None  # None: same as num_heads (plain multi-head attention)
    mlp_hidden: int | None = None  # None: SwiGLU width 8/3 * dim rounded up to a multiple of 8
    num_streams: int = 4  # S; 1 = plain residual stream, exactly a pre-norm transformer
    sinkhorn_iters: int = 20
    mhc_eps: float = 1e-6  # eps of H_pre = sigmoid + eps and of the Sinkhorn entries/denominators
    # the residual streams' dtype under autocast: "fp32" (kept in fp32), or "autocast" (the
    # autocast dtype, e.g. bf16: half the bytes the mixes move and the backward saves)
    residual_dtype: Literal["fp32", "autocast"] = "fp32"
    mtp_depth: int = 1  # M; 0 = no multi-token prediction
    mtp_loss_weight: float = 0.3  # lambda in L = L_main + lambda/M * sum_k L_k
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    moe: MoEConfig | None = None  # None: every feed-forward is a dense SwiGLU
    # None: grouped-query attention (Llama family); set: DeepSeek-V4 attention (docs/v4.md)
    attention: V4AttentionConfig | None = None
    # Llama-family options (HuggingFace import, docs/interop.md); defaults are the plain model.
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    attn_out_bias: bool = False  # bias on the attention output projection (Llama attention_bias)
    qk_norm: bool = False  # RMSNorm over the head dim of q and k, per head, before rope (Qwen3)
    attn_head_dim: int | None = None  # None: dim // num_heads; set when a checkpoint's differs
    rope_scaling: RopeScaling = "none"  # inverse-frequency variant, see rope_inv_freq in layers.py
    rope_factor: float = 1.0  # context extension factor (linear, llama3, yarn)
    rope_original_max_seq_len: int | None = None  # pre-training context (llama3, yarn)
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_truncate: bool = True  # yarn: floor/ceil the correction range
    rope_attention_factor: float = 1.0  # multiplies cos and sin (yarn's mscale)

    def __post_init__(self) -> None:
        check_llama_options(self)
        if self.attention is not None:
            check_v4_options(self)
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "max_seq_len"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "must be an int >= 1")
        check(
            self.attention is not None
            or self.attn_head_dim is not None
            or self.dim % self.num_heads == 0,
            "dim",
            self.dim,
            "must divide by num_heads (or set attn_head_dim)",
        )
        check(self.head_dim >= 2 and self.head_dim % 2 == 0, "head_dim", self.head_dim, "even >= 2")
        kv = self.num_kv_heads
        check(
            kv is None or (kv >= 1 and self.num_heads % kv == 0),
            "num_kv_heads",
            kv,
            f"must be >= 1 and divide num_heads={self.num_heads}",
        )
        hidden = self.mlp_hidden
        check(hidden is None or hidden >= 1, "mlp_hidden", hidden, "must be >= 1")
        check(self.num_streams >= 1, "num_streams", self.num_streams, "must be >= 1")
        check(self.sinkhorn_iters >= 1, "sinkhorn_iters", self.sinkhorn_iters, "must be >= 1")
        check(0 < self.mhc_eps < 1e-2, "mhc_eps", self.mhc_eps, "must be in (0, 1e-2)")
        residual = self.residual_dtype
        check(residual in ("fp32", "autocast"), "residual_dtype", residual, "fp32|autocast")
        check(self.mtp_depth >= 0, "mtp_depth", self.mtp_depth, "must be >= 0")
        w = self.mtp_loss_weight
        check(math.isfinite(w) and w >= 0, "mtp_loss_weight", w, "must be finite and >= 0")
        check(self.rope_theta > 0, "rope_theta", self.rope_theta, "must be > 0")
        check(self.norm_eps > 0, "norm_eps", self.norm_eps, "must be > 0")

    @property
    def head_dim(self) -> int:
        if self.attention is not None:
            return self.attention.head_dim
        return self.dim // self.num_heads if self.attn_head_dim is None else self.attn_head_dim

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def ffn_dim(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 8 * ((8 * self.dim // 3 + 7) // 8)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        # the kernel choice left the model config for the runtime's (Kernels, above)
        data = {k: v for k, v in data.items() if k not in RETIRED_MODEL_FIELDS}
        reject_unknown_fields(cls, data)
        if isinstance(data.get("moe"), dict):
            data = {**data, "moe": MoEConfig.from_dict(data["moe"])}
        if isinstance(data.get("attention"), dict):
            data = {**data, "attention": V4AttentionConfig.from_dict(data["attention"])}
        return cls(**data)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    """Mixture-of-experts feed-forward (DeepSeek-V3 routing, DeepSeek-V4 options); docs/moe.md."""

    num_experts: int  # E routed experts
    experts_per_token: int  # top-k routed experts per token
    expert_hidden: int  # F of each expert's SwiGLU (shared experts use the same width)
    num_shared_experts: int = 1  # always-active experts, one SwiGLU of width n * expert_hidden
    num_dense_layers: int = 1  # the first layers keep the dense SwiGLU
    mtp_moe: bool = True  # MTP depths use the MoE feed-forward too
    route_scale: float = 1.0  # routed output scale after the gates are normalised
    bias_update_rate: float = 1e-3  # gamma: per-update step of the load-balancing bias
    balance_loss_weight: float = 0.0  # alpha of the balance loss; 0 = off
    # DeepSeek-V4 options (defaults: DeepSeek-V3)
    scoring: Scoring = "sigmoid"  # affinity of the router logits: sigmoid|softmax|sqrtsoftplus
    num_hash_layers: int = 0  # the first MoE layers pick experts by token id (tid2eid table)
    swiglu_limit: float | None = None  # clamp gate <= l and up to [-l, l] in every expert
    balance_loss: BalanceLoss = "sequence"  # sequence (DeepSeek-V3) | switch (V4's, per layer)

    def __post_init__(self) -> None:
        for name in ("num_experts", "experts_per_token", "expert_hidden"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "must be an int >= 1")
        k = self.experts_per_token
        check(
            k <= self.num_experts,
            "experts_per_token",
            k,
            f"must be <= num_experts={self.num_experts}",
        )
        for name in ("num_shared_experts", "num_dense_layers", "num_hash_layers"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 0, name, value, "must be an int >= 0")
        check(isinstance(self.mtp_moe, bool), "mtp_moe", self.mtp_moe, "must be a bool")
        r = self.route_scale
        check(math.isfinite(r) and r > 0, "route_scale", r, "must be finite and > 0")
        for name in ("bias_update_rate", "balance_loss_weight"):
            value = getattr(self, name)
            check(math.isfinite(value) and value >= 0, name, value, "must be finite and >= 0")
        check(self.scoring in SCORINGS, "scoring", self.scoring, " | ".join(SCORINGS))
        limit = self.swiglu_limit
        check(
            limit is None or (math.isfinite(limit) and limit > 0),
            "swiglu_limit",
            limit,
            "must be None or finite and > 0",
        )
        loss = self.balance_loss
        check(loss in BALANCE_LOSSES, "balance_loss", loss, " | ".join(BALANCE_LOSSES))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MoEConfig:
        reject_unknown_fields(cls, data)
        return cls(**data)


V4LayerType = Literal[
    "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
]
V4_LAYER_TYPES: tuple[str, ...] = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class V4AttentionConfig:
    """DeepSeek-V4 attention (docs/v4.md). Fields are named as transformers' DeepseekV4Config
    names them (`compress_rates` is split into its two entries); the number of query heads is
    `ModelConfig.num_heads`, the main rope base `ModelConfig.rope_theta`, and a yarn scaling in
    ModelConfig's rope fields applies to the compressed branches' rope only, as in V4."""

    q_lora_rank: int  # rank of the low-rank query projection (q_a_proj -> q_b_proj)
    head_dim: int  # K of the queries and of the one shared key/value head
    qk_rope_head_dim: int  # trailing slice of each head that gets (interleaved) rope
    layer_types: tuple[V4LayerType, ...]  # one per layer: sliding | CSA | HCA
    sliding_window: int = 128  # keys t-window+1..t of the sliding branch
    compress_rate_csa: int = 4  # tokens per compressed entry in CSA layers (overlapping windows)
    compress_rate_hca: int = 128  # tokens per compressed entry in HCA layers
    compress_rope_theta: float = 160000.0  # rope base of CSA/HCA layers and their compressors
    index_n_heads: int = 64  # the CSA indexer's query heads
    index_head_dim: int = 128  # the CSA indexer's head dim
    index_topk: int = 512  # compressed entries each query keeps in CSA layers
    o_groups: int = 8  # head groups of the grouped output projection
    o_lora_rank: int = 1024  # per-group width of the grouped output projection

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # JSON gives a list
        for name in (
            "q_lora_rank",
            "head_dim",
            "qk_rope_head_dim",
            "sliding_window",
            "compress_rate_csa",
            "compress_rate_hca",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "o_groups",
            "o_lora_rank",
        ):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "must be an int >= 1")
        rope = self.qk_rope_head_dim
        check(
            rope % 2 == 0 and rope <= self.head_dim, "qk_rope_head_dim", rope, "even, <= head_dim"
        )
        check(self.index_head_dim % 2 == 0, "index_head_dim", self.index_head_dim, "must be even")
        check(
            self.index_head_dim >= rope,
            "index_head_dim",
            self.index_head_dim,
            f"must be >= qk_rope_head_dim={rope} (its rope slice)",
        )
        theta = self.compress_rope_theta
        check(math.isfinite(theta) and theta > 0, "compress_rope_theta", theta, "finite and > 0")
        bad = [t for t in self.layer_types if t not in V4_LAYER_TYPES]
        check(not bad, "layer_types", bad, f"entries must be one of {V4_LAYER_TYPES}")

    def layer_type(self, index: int) -> V4LayerType:
        """The kind of layer `index`; blocks past the decoder (MTP depths) are sliding."""
        return self.layer_types[index] if index < len(self.layer_types) else "sliding_attention"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> V4AttentionConfig:
        reject_unknown_fields(cls, data)
        return cls(**data)


def check_v4_options(cfg: ModelConfig) -> None:
    """Cross-field checks of a ModelConfig with V4 attention (`cfg.attention`)."""
    v4 = cfg.attention
    check(isinstance(v4, V4AttentionConfig), "attention", v4, "a V4AttentionConfig or None")
    assert isinstance(v4, V4AttentionConfig)
    n = len(v4.layer_types)
    check(n == cfg.num_layers, "attention.layer_types", n, f"needs num_layers={cfg.num_layers}")
    check(cfg.num_kv_heads == 1, "num_kv_heads", cfg.num_kv_heads, "V4 has one shared KV head")
    check(
        cfg.num_heads % v4.o_groups == 0,
        "attention.o_groups",
        v4.o_groups,
        f"must divide num_heads={cfg.num_heads}",
    )
    for name in ("qkv_bias", "attn_out_bias", "qk_norm"):
        check(not getattr(cfg, name), name, getattr(cfg, name), "not an option of V4 attention")
    check(cfg.attn_head_dim is None, "attn_head_dim", cfg.attn_head_dim, "V4: attention.head_dim")
    scaling = cfg.rope_scaling
    check(scaling in ("none", "yarn"), "rope_scaling", scaling, "V4 attention: none | yarn")


Scoring = Literal["sigmoid", "softmax", "sqrtsoftplus"]
SCORINGS: tuple[str, ...] = ("sigmoid", "softmax", "sqrtsoftplus")
BalanceLoss = Literal["sequence", "switch"]
BALANCE_LOSSES: tuple[str, ...] = ("sequence", "switch")
RopeScaling = Literal["none", "linear", "llama3", "yarn"]
ROPE_SCALINGS: tuple[str, ...] = ("none", "linear", "llama3", "yarn")


def check_llama_options(cfg: ModelConfig) -> None:
    """Validate the Llama-family option group of ModelConfig (attention extras, rope scaling)."""
    for name in ("qkv_bias", "attn_out_bias", "qk_norm", "rope_truncate"):
        check(isinstance(getattr(cfg, name), bool), name, getattr(cfg, name), "must be a bool")
    hd = cfg.attn_head_dim
    check(hd is None or (isinstance(hd, int) and hd >= 2), "attn_head_dim", hd, "int >= 2 or None")
    scaling = cfg.rope_scaling
    check(scaling in ROPE_SCALINGS, "rope_scaling", scaling, " | ".join(ROPE_SCALINGS))
    for name in (
        "rope_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_beta_fast",
        "rope_beta_slow",
        "rope_attention_factor",
    ):
        value = getattr(cfg, name)
        check(math.isfinite(value) and value > 0, name, value, "must be finite and > 0")
    if scaling in ("llama3", "yarn"):
        orig = cfg.rope_original_max_seq_len
        check(
            orig is not None and orig >= 1,
            "rope_original_max_seq_len",
            orig,
            f"must be an int >= 1 with rope_scaling={scaling!r}",
        )
    if scaling == "llama3":
        check(
            cfg.rope_high_freq_factor > cfg.rope_low_freq_factor,
            "rope_high_freq_factor",
            cfg.rope_high_freq_factor,
            "must be > rope_low_freq_factor",
        )
    if scaling != "yarn":
        check(
            cfg.rope_attention_factor == 1.0,
            "rope_attention_factor",
            cfg.rope_attention_factor,
            "only rope_scaling='yarn' scales cos/sin",
        )


def resolve_kernels(cfg: ModelConfig, kernels: Kernels) -> Kernels:
    """The kernel choice a model of `cfg` runs on, for the trainer and the engine alike.

    "auto" means "the fused kernels where they exist". V4 attention (and its compressor,
    indexer and hash-routed MoE) has none yet, and the fused step and mHC paths assume the
    Llama-shaped layers (rope tables, folded projections), so a V4 model under "auto" runs on
    the eager ops; "triton" asks for fused kernels by name and is refused."""
    check(kernels in KERNELS, "kernels", kernels, " | ".join(KERNELS))
    if cfg.attention is None:
        return kernels
    check(
        kernels != "triton",
        "kernels",
        kernels,
        "V4 attention has no fused kernels: use kernels='auto' or 'eager'",
    )
    return "eager"


def kernels_note(cfg: ModelConfig, kernels: Kernels, device: str) -> str | None:
    """One line for a run's output where `resolve_kernels` changes what `kernels` would pick on
    `device` (a V4 model under "auto" on CUDA), else None."""
    if cfg.attention is None or kernels != "auto" or not str(device).startswith("cuda"):
        return None
    return "kernels: 'auto' runs this V4 model on the eager ops (no fused V4 kernels yet)"
