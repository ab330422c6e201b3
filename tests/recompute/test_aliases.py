"""The alias matrix: safe reclaim never frees a storage someone reads, in any order.

{view, chunk, detach, .data, set_, as_strided} x {a pending node saves the base, none does} x
{checkpoint backward first, reader first}. The checkpoint's input is an alias of `base`; the
reader saves `base` itself. "safe" must never free the storage before the reader has run, must
give the same gradients as the plain graph, must leave the storage intact while the caller
holds `base`, and must let it die after backward when the caller does not.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from birkhoff.recompute import UseAfterFreeError, checkpoint, sanitize, track_saved_storages

ALIASES: dict[str, Callable[[Tensor], Tensor]] = {
    "view": lambda b: b.view(-1),
    "chunk": lambda b: b.chunk(2, dim=0)[1],
    "detach": lambda b: b.detach(),
    "data": lambda b: b.data,
    "set_": lambda b: torch.empty(0, dtype=b.dtype).set_(b.detach()),
    "as_strided": lambda b: b.as_strided((2, 3), (1, 4), 1),
}


def build_and_run(alias: str, reader: bool, checkpoint_first: bool, reclaim: str | None):
    """Returns (grads, order of the nodes that ran, base bytes when the reader ran, base)."""
    g = torch.Generator().manual_seed(0)
    leaf = torch.randn(4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, generator=g, requires_grad=True)
    order: list[str] = []
    seen: list[int] = []

    def fn(a: Tensor) -> Tensor:
        return torch.tanh(a.square().sum() * w)

    def make_reader(base: Tensor) -> Tensor:
        y = base.sin()  # SinBackward0 saves base (self)
        y.grad_fn.register_prehook(lambda g: order.append("reader"))
        y.grad_fn.register_prehook(lambda g: seen.append(base.untyped_storage().nbytes()))
        return y

    with track_saved_storages():
        base = leaf * 1.5
        # Autograd runs the ready node created last first: a reader built before the checkpoint
        # runs after it.
        y = make_reader(base) if reader and checkpoint_first else None
        a = ALIASES[alias](base)
        out = fn(a) if reclaim is None else checkpoint(fn, a, reclaim=reclaim, name="ckpt")
        out.grad_fn.register_prehook(lambda g: order.append("checkpoint"))
        y = make_reader(base) if reader and not checkpoint_first else y
        loss = out.sum() + (y.sum() if y is not None else 0.0)
    loss.backward()
    return (leaf.grad, w.grad), order, seen, base


CASES = [
    (alias, reader, first)
    for alias in ALIASES
    for reader in (True, False)
    for first in (True, False)
    if reader or first  # without a reader the order is moot
]


@pytest.mark.parametrize(("alias", "reader", "checkpoint_first"), CASES)
def test_safe_reclaim_alias_matrix(alias: str, reader: bool, checkpoint_first: bool) -> None:
    ref_grads, ref_order, _, _ = build_and_run(alias, reader, checkpoint_first, None)
    with sanitize():
        grads, order, seen, base = build_and_run(alias, reader, checkpoint_first, "safe")
    if reader:
        assert order == (["checkpoint", "reader"] if checkpoint_first else ["reader", "checkpoint"])
        assert seen and seen[0] == base.numel() * base.element_size()  # not freed before it ran
    for r, o in zip(ref_grads, grads, strict=True):
        assert (r is None and o is None) or torch.equal(r, o)
    assert base.untyped_storage().nbytes() == base.numel() * base.element_size()  # caller's


@pytest.mark.parametrize(("alias", "reader", "checkpoint_first"), CASES)
def test_storage_dies_after_backward_when_only_autograd_held_it(
    alias: str, reader: bool, checkpoint_first: bool
) -> None:
    with sanitize():
        _, _, _, base = build_and_run(alias, reader, checkpoint_first, "safe")
    ref = StorageWeakRef(base.untyped_storage())
    del base
    assert ref.expired()


@pytest.mark.parametrize("alias", list(ALIASES))
def test_always_frees_under_a_pending_reader(alias: str) -> None:
    """Control: the unconditional free is caught for every alias kind."""
    with sanitize(), pytest.raises(UseAfterFreeError, match="SinBackward0") as err:
        build_and_run(alias, reader=True, checkpoint_first=True, reclaim="always")
    assert err.value.freed_by == "ckpt"
