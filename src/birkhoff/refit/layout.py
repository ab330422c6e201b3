"""Trainer layout -> engine (inference) layout: names and fusions, shared by engine and refit.

The engine serves fused projections: `attn.wqkv.weight` = cat(wq, wk, wv) and
`mlp.w_gate_up.weight` = cat(w_gate, w_up) along the output dim (dim 0). Every other tensor keeps
its trainer name. With tied embeddings the engine serves `embed.weight` once and uses it as the
lm_head. The MTP drafter (`mtp.{k}.*`) is mapped exactly like the main model.

`to_engine_layout` is a streaming transform: it consumes (name, tensor) pairs in any order and
yields each engine tensor as soon as all of its parts have arrived, so refit can bucket without
materialising the whole engine state dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from birkhoff.config import ModelConfig

# fused engine suffix -> trainer suffixes, in concatenation order
FUSIONS: dict[str, tuple[str, ...]] = {
    "attn.wqkv.weight": ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight"),
    "mlp.w_gate_up.weight": ("mlp.w_gate.weight", "mlp.w_up.weight"),
}
_PART_OF = {part: (fused, i) for fused, parts in FUSIONS.items() for i, part in enumerate(parts)}

# engine tensors that are matmul weights (candidates for fp8); never norms, embeddings, mHC
MATMUL_SUFFIXES = (
    "attn.wqkv.weight",
    "attn.wo.weight",
    "mlp.w_gate_up.weight",
    "mlp.w_down.weight",
    "proj.weight",
    "lm_head.weight",
)


def split_fused_part(trainer_name: str) -> tuple[str, int, int] | None:
    """(engine name, part index, number of parts) if `trainer_name` is part of a fusion."""
    for part, (fused, index) in _PART_OF.items():
        if trainer_name.endswith("." + part):
            prefix = trainer_name[: -len(part)]
            return prefix + fused, index, len(FUSIONS[fused])
    return None


def is_matmul_weight(engine_name: str) -> bool:
    return engine_name.endswith(MATMUL_SUFFIXES)


def trainer_tensors(
    model: torch.nn.Module, cfg: ModelConfig, *, detach: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """The trainer tensors the engine needs, once each (a tied lm_head is skipped).

    The state_dict's entries (parameters, then persistent buffers; detached, not copied), read
    through named_parameters/named_buffers: `state_dict()` costs ~10 us per module in hooks and
    recursion, which a refit of a few hundred tensors pays on every update. `detach=False`
    yields the Parameter objects themselves (a refit plan keeps them: reading a Parameter always
    gives its current data, even after `param.data = ...`).
    """
    for name, tensor in model.named_parameters(remove_duplicate=False):
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue
        yield name, tensor.detach() if detach else tensor
    for name, buffer in model.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            yield name, buffer.detach() if detach else buffer


def engine_sources(named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, list[Tensor]]]:
    """(engine name, parts) as soon as all parts are in; the engine tensor is cat(parts, dim=0).

    Unfused tensors come through as one part. Raises ValueError if a fusion is left incomplete
    or a part arrives twice. Refit packs the parts straight into buckets (no concatenation).
    """
    pending: dict[str, list[Tensor | None]] = {}
    for name, tensor in named:
        fused = split_fused_part(name)
        if fused is None:
            yield name, [tensor]
            continue
        engine_name, index, num_parts = fused
        parts = pending.setdefault(engine_name, [None] * num_parts)
        if parts[index] is not None:
            raise ValueError(f"trainer tensor {name!r} arrived twice")
        parts[index] = tensor
        if all(p is not None for p in parts):
            yield engine_name, [p for p in parts if p is not None]
            del pending[engine_name]
    if pending:
        raise ValueError(f"incomplete fusions (missing parts): {sorted(pending)}")


def to_engine_layout(named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """Map trainer (name, tensor) pairs to engine pairs, fusing q/k/v and gate/up."""
    for name, parts in engine_sources(named):
        yield name, parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def engine_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the engine serves, derived from a meta-device model."""
    from birkhoff.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(t.shape) for name, t in to_engine_layout(trainer_tensors(model, cfg))}
