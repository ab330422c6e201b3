"""Which storages pending autograd nodes still read, which the forward allocated, what died.

A `StorageRegistry` is the bookkeeping behind `track_saved_storages()`. It decides nothing about
freeing; it lets the sanitizer and the census say what happened to a storage: pending readers
(every tensor saved outside checkpoints wrapped in a `SavedRef`), forward allocations (noted by a
`TorchDispatchMode` while grad mode is on) and the storages a checkpoint released or freed, with
its label. Storage identity is `untyped_storage()._cdata` and liveness a `StorageWeakRef`; the
holder records `_version` because autograd skips its in-place check under hooks. Details:
docs/recompute.md.
Left out: tensors without storage (sparse, nested) are saved untracked.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
)
from torch.utils._pytree import tree_leaves

from birkhoff.recompute import sanitizer


def storage_key(t: Tensor) -> int | None:
    """Identity of the storage behind `t` (shared by all aliases); None if it has none."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None


def free_storage(t: Tensor) -> None:
    """Free the storage behind `t` for every alias, ordered after the current stream's work."""
    if t.is_cuda:
        # The caching allocator may hand the block to its allocating stream at once; recording
        # the current stream makes it wait for the work queued here (backward's stream).
        t.record_stream(torch.cuda.current_stream(t.device))
    t.untyped_storage().resize_(0)


class SavedRef:
    """Holder of one saved tensor; counts as a pending reader of its storage while alive."""

    __slots__ = ("registry", "tensor", "key", "version", "nbytes", "scope")

    def __init__(self, registry: StorageRegistry, t: Tensor, key: int, scope: str) -> None:
        self.registry, self.key, self.scope = registry, key, scope
        self.tensor = t.detach()  # shares storage and version counter, breaks the grad_fn cycle
        self.version = t._version
        self.nbytes = t.untyped_storage().nbytes()
        registry.acquire(key)

    def unpack(self) -> Tensor:
        if sanitizer.is_enabled():
            sanitizer.check_saved(self)
        if self.tensor._version != self.version:
            raise RuntimeError(
                f"a tensor saved for backward (saved in {self.scope!r}) was modified in place "
                f"after it was saved: version {self.tensor._version}, expected {self.version}"
            )
        return self.tensor

    def __del__(self) -> None:
        self.registry.release(self)


class StorageRegistry:
    """Pending saved readers per storage, forward-allocated storages, releases and frees."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.readers: dict[int, int] = {}  # storage key -> live SavedRef holders on it
        self.allocated: dict[int, StorageWeakRef] = {}  # storages born in the tracked forward
        self.released: dict[int, tuple[StorageWeakRef, str]] = {}  # key -> (storage, label)
        self.resized: dict[int, str] = {}  # key -> label of the checkpoint that resized it to 0
        self.record_paused = 0  # > 0 inside checkpointed functions and their reruns

    def acquire(self, key: int) -> None:
        with self._lock:
            self.readers[key] = self.readers.get(key, 0) + 1

    def release(self, ref: SavedRef) -> None:
        with self._lock:
            left = self.readers[ref.key] - 1
            if left > 0:
                self.readers[ref.key] = left
            else:
                del self.readers[ref.key]

    def record_allocation(self, t: Tensor) -> None:
        key = storage_key(t)
        if key is not None and key not in self.allocated:
            self.allocated[key] = StorageWeakRef(t.untyped_storage())

    def note_released(self, t: Tensor, label: str) -> None:
        """A checkpoint labelled `label` dropped its reference to the storage of `t`."""
        key = storage_key(t)
        if key is not None and key not in self.released:
            self.released[key] = (StorageWeakRef(t.untyped_storage()), label)

    @property
    def freed(self) -> dict[int, str]:
        """Storage key -> label of the checkpoint after whose release (or free) it died."""
        died = {k: label for k, (ref, label) in self.released.items() if ref.expired()}
        return {**died, **self.resized}

    def free(self, t: Tensor, label: str) -> None:
        """Resize the storage of `t` to 0 bytes, whoever holds it (reclaim="always" only)."""
        key = storage_key(t)
        assert key is not None, "free() needs a tensor with a storage"
        free_storage(t)
        self.resized[key] = label

    @contextmanager
    def recording_paused(self) -> Iterator[None]:
        """Stop noting allocations (inside checkpointed functions and their reruns).

        The recorder is popped when it is the innermost mode, so ops inside pay no dispatch
        cost; otherwise (a rerun in backward, another mode on top) a counter mutes it.
        """
        recorder = next((rec for reg, rec in _STACK if reg is self), None)
        self.record_paused += 1
        try:
            if recorder is not None and _get_current_dispatch_mode() is recorder:
                with _pop_mode_temporarily():
                    yield
            else:
                yield
        finally:
            self.record_paused -= 1

    def pack(self, t: Tensor) -> Any:
        key = storage_key(t)
        if key is None:
            return t
        return SavedRef(self, t, key, sanitizer.current_scope())


def _unpack(packed: Any) -> Tensor:
    return packed.unpack() if isinstance(packed, SavedRef) else packed


class AllocationRecorder(TorchDispatchMode):
    """Records the storages that ops create while grad mode is on (i.e. during a forward)."""

    def __init__(self, registry: StorageRegistry) -> None:
        super().__init__()
        self.registry = registry

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Backward runs with grad mode off; recompute pauses recording explicitly.
        if self.registry.record_paused or not torch.is_grad_enabled():
            return out
        seen = {_leaf_key(x) for x in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and storage_key(t) not in seen:
                self.registry.record_allocation(t)
        return out


def _leaf_key(x: object) -> int | None:
    if isinstance(x, Tensor):
        return storage_key(x)
    if isinstance(x, torch.UntypedStorage):  # set_(storage) aliases its argument
        return int(x._cdata)
    return None


_STACK: list[tuple[StorageRegistry, AllocationRecorder]] = []
_LAST: list[StorageRegistry] = []


def active_registry() -> StorageRegistry | None:
    """The registry of the innermost `track_saved_storages()` context, if any."""
    return _STACK[-1][0] if _STACK else None


def last_registry() -> StorageRegistry | None:
    """The registry of the most recent tracked forward (for the census)."""
    return _LAST[-1] if _LAST else None


@contextmanager
def track_saved_storages() -> Iterator[StorageRegistry]:
    """Wrap a forward: tracks saved tensors and allocations for the census and the sanitizer.

    Checkpoints run inside it also record what they release. Run the backward outside it.
    Yields the registry (also `last_registry()` afterwards).
    """
    registry = StorageRegistry()
    recorder = AllocationRecorder(registry)
    _LAST[:] = [registry]
    _STACK.append((registry, recorder))
    try:
        with torch.autograd.graph.saved_tensors_hooks(registry.pack, _unpack), recorder:
            yield registry
    finally:
        _STACK.pop()
