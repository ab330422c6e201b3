"""Which storages pending autograd nodes still read, and which storages the forward allocated.

A `StorageRegistry` answers the two questions safe reclaim asks about a checkpoint input:
(a) does any autograd node that has not run yet hold a saved tensor on this storage, through any
alias?  (b) was the storage allocated during the tracked forward (an activation), as opposed to
a parameter, a buffer or a user input?

Design choices:
- Storage identity is `untyped_storage()._cdata`: every alias (view, chunk, detach, `.data`,
  `set_`, as_strided) shares it, while `data_ptr()` differs per view and `_base` misses `.data`
  and `set_`.
- (a) is a reference count. `track_saved_storages()` installs `saved_tensors_hooks` whose pack
  returns a `SavedRef` holder; autograd drops the holder when the node releases its saved tensors
  (right after it runs, or when the graph dies), and `SavedRef.__del__` decrements the count.
  A checkpoint's own inputs are held by the same kind of holder, so two checkpoints sharing an
  input also see each other.
- Freeing is deferred to the moment the count reaches zero: a checkpoint that may reclaim an
  input marks its storage, and whichever holder is dropped last frees it. The outcome therefore
  does not depend on the order in which backward runs the readers.
- (b) is recorded by a `TorchDispatchMode` that notes every storage an op creates (an output
  whose storage is not one of the op's inputs') while grad mode is on, and by `checkpoint` for
  its own outputs. Inside checkpointed functions the mode is popped, so its cost is a few dozen
  ops per step, not one per op of the model.
- With hooks active autograd skips its in-place check, so the holder records `_version` at pack
  time and unpack compares.
Left out: tensors without storage (sparse, nested) are saved untracked; nothing here frees a
storage that was not marked by a checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
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
    """Pending saved readers per storage, forward-allocated storages, reclaim requests."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.readers: dict[int, int] = {}  # storage key -> live SavedRef holders on it
        self.allocated: dict[int, StorageWeakRef] = {}  # storages born in the tracked forward
        self.reclaim: dict[int, str] = {}  # key -> label of the checkpoint that may free it
        self.freed: dict[int, str] = {}  # key -> label of the checkpoint that freed it
        self.record_paused = 0  # > 0 inside checkpointed functions and recompute

    def acquire(self, key: int) -> None:
        with self._lock:
            self.readers[key] = self.readers.get(key, 0) + 1

    def release(self, ref: SavedRef) -> None:
        with self._lock:
            left = self.readers[ref.key] - 1
            if left > 0:
                self.readers[ref.key] = left
                return
            del self.readers[ref.key]
            label = self.reclaim.pop(ref.key, None)
        if label is not None and ref.tensor.untyped_storage().nbytes() > 0:
            self.free(ref.tensor, label)

    def pending(self, t: Tensor) -> int:
        """Number of live saved holders (pending readers) on the storage of `t`."""
        key = storage_key(t)
        return 0 if key is None else self.readers.get(key, 0)

    def record_allocation(self, t: Tensor) -> None:
        key = storage_key(t)
        if key is not None and key not in self.allocated:
            self.allocated[key] = StorageWeakRef(t.untyped_storage())

    def is_activation(self, t: Tensor) -> bool:
        """True if the storage of `t` was allocated during the tracked forward (and is alive)."""
        key = storage_key(t)
        ref = None if key is None else self.allocated.get(key)
        return ref is not None and not ref.expired()

    def request_reclaim(self, ref: SavedRef, label: str) -> None:
        """Free `ref`'s storage once no holder reads it, if the forward allocated it."""
        if self.is_activation(ref.tensor):
            with self._lock:
                self.reclaim.setdefault(ref.key, label)

    def free(self, t: Tensor, label: str) -> None:
        key = storage_key(t)
        assert key is not None, "free() needs a tensor with a storage"
        free_storage(t)
        self.freed[key] = label

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


def active_recorder() -> AllocationRecorder | None:
    return _STACK[-1][1] if _STACK else None


def last_registry() -> StorageRegistry | None:
    """The registry of the most recent tracked forward (for the census)."""
    return _LAST[-1] if _LAST else None


@contextmanager
def track_saved_storages() -> Iterator[StorageRegistry]:
    """Wrap a forward: registers saved tensors and forward allocations for safe reclaim.

    Run the backward outside it. Yields the registry (also `last_registry()` afterwards).
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
