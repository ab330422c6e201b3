"""Census of activation storage: what the last tracked forward allocated that is still alive.

After backward, every activation of a step should be gone; storages that stay alive are held by
references autograd does not know about (module attributes, Python lists, closures), i.e. leaks
that last until the next step overwrites them. `census()` counts them from the weak references
the registry took when the forward allocated each storage; a storage that a checkpoint
reclaimed is alive but has 0 bytes, so it does not count.

`PeakLiveBytes` is a measuring tool for CPU benchmarks: a dispatch mode that tracks the bytes of
every storage created inside it and reports the peak of the live total, re-reading sizes after
every op so storage freed by `resize_(0)` is seen at once.
Left out: storages allocated during backward (recomputed activations) are not in the census.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from birkhoff.recompute.registry import StorageRegistry, last_registry, storage_key


@dataclass(frozen=True, kw_only=True, slots=True)
class Census:
    live_bytes: int  # bytes of forward-allocated storages still alive (and not reclaimed)
    live_storages: int  # how many such storages
    tracked_storages: int  # how many storages the forward allocated in all


def _nbytes(ref: StorageWeakRef) -> int:
    if ref.expired():
        return 0
    return int(torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes())


def census(registry: StorageRegistry | None = None) -> Census:
    """Live bytes of the storages allocated during the last (or the given) tracked forward."""
    registry = registry or last_registry()
    if registry is None:
        raise RuntimeError("census() needs a forward run inside track_saved_storages() first")
    sizes = [_nbytes(ref) for ref in registry.allocated.values()]
    live = [n for n in sizes if n > 0]
    return Census(live_bytes=sum(live), live_storages=len(live), tracked_storages=len(sizes))


class PeakLiveBytes(TorchDispatchMode):
    """Peak of the live bytes of storages created by ops run inside this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, StorageWeakRef] = {}
        self.peak_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            key = storage_key(t) if isinstance(t, Tensor) else None
            if key is not None and (key not in self.refs or self.refs[key].expired()):
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
