"""Use-after-free detection for reclaimed activation storage.

Inside `sanitize()`, every tensor saved under `track_saved_storages()` is checked when its
autograd node unpacks it, before any kernel reads it. A freed storage (size 0 while it had bytes
at save time) raises `UseAfterFreeError` naming the node, the module whose forward saved the
tensor (recorded by global forward hooks installed only while sanitizing) and the checkpoint
that freed the storage. Checking at unpack costs nothing for nodes that save nothing. Design
choices: docs/recompute.md.
Left out: nodes whose tensors were saved outside `track_saved_storages()` are not checked, and
reads of freed storage outside autograd (module attributes, Python lists) cannot be seen.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

if TYPE_CHECKING:
    from birkhoff.recompute.registry import SavedRef


class UseAfterFreeError(RuntimeError):
    """An autograd node is about to read a storage that a checkpoint already freed."""

    def __init__(self, *, node: str, scope: str, freed_by: str) -> None:
        super().__init__(
            f"autograd node {node} (saved in {scope!r}) reads a storage that checkpoint "
            f"{freed_by!r} freed: that node was still pending when the storage was reclaimed"
        )
        self.node, self.scope, self.freed_by = node, scope, freed_by


class _State(threading.local):
    def __init__(self) -> None:
        self.scopes: list[tuple[str, dict[int, str]]] = []  # (qualified name, names of the root)


_ENABLED = [0]
_TLS = _State()


def is_enabled() -> bool:
    return _ENABLED[0] > 0


def current_scope() -> str:
    """Qualified name of the innermost module running its forward ('' when not sanitizing)."""
    if not is_enabled():
        return ""
    return _TLS.scopes[-1][0] if _TLS.scopes else "<outside any module>"


def _enter(module: nn.Module, args: Any) -> None:
    scopes = _TLS.scopes
    # The outermost module names everything below it.
    names = scopes[-1][1] if scopes else {id(m): n for n, m in module.named_modules()}
    name = names.get(id(module)) or type(module).__name__
    scopes.append((name, names))


def _exit(module: nn.Module, args: Any, output: Any) -> None:
    if _TLS.scopes:
        _TLS.scopes.pop()


def check_saved(ref: SavedRef) -> None:
    """Raise `UseAfterFreeError` if the storage `ref` holds was freed."""
    if ref.nbytes == 0 or ref.tensor.untyped_storage().nbytes() > 0:
        return
    node = torch._C._current_autograd_node()
    node_name = node.name() if node is not None else "<no running node>"
    freed_by = ref.registry.freed.get(ref.key, "<freed outside birkhoff.recompute>")
    raise UseAfterFreeError(node=node_name, scope=ref.scope, freed_by=freed_by)


@contextmanager
def sanitize() -> Iterator[None]:
    """Check every tracked saved tensor for use after free; wrap forward and backward."""
    _ENABLED[0] += 1
    handles = [
        register_module_forward_pre_hook(_enter),
        register_module_forward_hook(_exit, always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        _ENABLED[0] -= 1
        _TLS.scopes.clear()
