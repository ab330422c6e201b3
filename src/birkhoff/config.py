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


def check(cond: bool, field: str, value: object, why: str) -> None:
    """Raise a ValueError naming `field` and `value` unless `cond` holds."""
    if not cond:
        raise ValueError(f"{field}={value!r} is invalid: {why}")


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
    mhc_kernels: Literal["auto", "eager", "triton"] = "auto"  # auto: fused Triton ops on CUDA
    mtp_depth: int = 1  # M; 0 = no multi-token prediction
    mtp_loss_weight: float = 0.3  # lambda in L = L_main + lambda/M * sum_k L_k
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "max_seq_len"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "must be an int >= 1")
        check(self.dim % self.num_heads == 0, "dim", self.dim, "must divide by num_heads")
        check(self.head_dim % 2 == 0, "dim", self.dim, "dim/num_heads must be even for rope")
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
        kernels = self.mhc_kernels
        check(kernels in ("auto", "eager", "triton"), "mhc_kernels", kernels, "auto|eager|triton")
        check(self.mtp_depth >= 0, "mtp_depth", self.mtp_depth, "must be >= 0")
        w = self.mtp_loss_weight
        check(math.isfinite(w) and w >= 0, "mtp_loss_weight", w, "must be finite and >= 0")
        check(self.rope_theta > 0, "rope_theta", self.rope_theta, "must be > 0")
        check(self.norm_eps > 0, "norm_eps", self.norm_eps, "must be > 0")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

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
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {unknown}")
        return cls(**data)
