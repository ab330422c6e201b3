"""Census of activation storage: what the last tracked forward allocated that is still alive.

After backward every activation of a step should be gone; storages still alive are held by
references autograd does not know (module attributes, lists, closures). `census()` counts them
from the registry's weak references and, given the model, names the module attributes that hold
tensors with their bytes. It reports and frees nothing. `PeakLiveBytes` is a dispatch mode for
CPU benchmarks that reports the peak of the live bytes of storages its ops create. Details:
docs/recompute.md.
Left out: storages allocated during backward (recomputed activations) are not in the census.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from birkhoff.recompute.registry import StorageRegistry, last_registry, storage_key


@dataclass(frozen=True, kw_only=True, slots=True)
class Census:
    live_bytes: int  # bytes of forward-allocated storages still alive (and not reclaimed)
    live_storages: int  # how many such storages
    tracked_storages: int  # how many storages the forward allocated in all
    pending_storages: int  # storages still saved by autograd nodes outside checkpoints
    # "<module>.<attribute>" -> bytes of the live storages tensors on it hold (model given)
    holders: dict[str, int] = field(default_factory=dict)


def _nbytes(ref: StorageWeakRef) -> int:
    if ref.expired():
        return 0
    return int(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes())


def census(registry: StorageRegistry | None = None, *, model: nn.Module | None = None) -> Census:
    """Live bytes of the storages allocated during the last (or the given) tracked forward.

    `pending_storages` counts storages that nodes which have not run (or a graph still alive)
    hold as saved tensors. With `model`, `holders` names every module attribute that holds a
    tensor (not a parameter or buffer) on a live storage, e.g. {"layers.0.moe.cache": 4096}.
    """
    registry = registry or last_registry()
    if registry is None:
        raise RuntimeError("census() needs a forward run inside track_saved_storages() first")
    sizes = [_nbytes(ref) for ref in registry.allocated.values()]
    live = [n for n in sizes if n > 0]
    holders = module_holders(model) if model is not None else {}
    return Census(
        live_bytes=sum(live),
        live_storages=len(live),
        tracked_storages=len(sizes),
        pending_storages=len(registry.readers),
        holders=holders,
    )


def module_holders(model: nn.Module) -> dict[str, int]:
    """Module attributes (one level into lists, tuples and dicts) holding non-empty tensors."""
    out: dict[str, int] = {}
    for prefix, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers", "_modules") or attr.startswith("__"):
                continue
            items = value.values() if isinstance(value, dict) else value
            tensors = [value] if isinstance(value, Tensor) else []
            if isinstance(value, list | tuple | dict):
                tensors = [t for t in items if isinstance(t, Tensor)]
            seen: dict[int, int] = {}
            for t in tensors:
                key = storage_key(t)
                if key is not None:
                    seen[key] = t.untyped_storage().nbytes()
            if sum(seen.values()) > 0:
                out[f"{prefix}.{attr}" if prefix else attr] = sum(seen.values())
    return out


class PeakLiveBytes(TorchDispatchMode):
    """Peak of the live bytes of storages created by ops run inside this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, StorageWeakRef] = {}
        self.peak_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (view, detach, in-place) allocated nothing: counting
        # it would add storages that existed before the measured code (parameters, inputs).
        inputs = {storage_key(x) for x in tree_leaves((args, kwargs)) if isinstance(x, Tensor)}
        for t in tree_leaves(out):
            key = storage_key(t) if isinstance(t, Tensor) else None
            if key is None or key in inputs:
                continue
            if key not in self.refs or self.refs[key].expired():
                self.refs[key] = StorageWeakRef(t.untyped_storage())
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return out

    def live_bytes(self, exclude: Collection[int] = ()) -> int:
        """Bytes of the live storages seen, less those keyed (`storage_key`) in `exclude`.

        In-place ops return existing tensors, so parameters and optimizer state an op updated
        are among those seen; a caller asking what a step left behind excludes them."""
        dead = [k for k, ref in self.refs.items() if ref.expired()]
        for key in dead:
            del self.refs[key]
        return sum(_nbytes(ref) for key, ref in self.refs.items() if key not in exclude)
