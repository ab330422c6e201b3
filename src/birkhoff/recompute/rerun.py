"""Inputs for a recompute that pin nothing: aliases whose graph leads to a 0-byte anchor.

A rerun on `x.detach().requires_grad_()` makes a leaf whose `AccumulateGrad` node lets any tensor
the rerun leaves behind (an MoE layer stashing recomputed tokens) keep the input's storage and
`.grad` alive. `rerun_alias(x)` returns a tensor on x's storage made by `_RerunAlias`, a node
that saves nothing and whose only input edge leads to an empty anchor; with a `GradSink` the
input gradient lands in the sink, emptied when the caller takes it. The alias itself is an
ordinary tensor: whoever keeps it keeps the storage, as they should. Why: docs/recompute.md.
Left out: freeing anything (storage dies with its last holder).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# Every rerun alias hangs off this leaf; it never receives a gradient.
_ANCHOR = torch.empty(0, requires_grad=True)


class GradSink:
    """Receives the gradient of one rerun input; `take()` hands it over and empties the sink."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: Tensor | None = None

    def take(self) -> Tensor | None:
        grad, self.grad = self.grad, None
        return grad


class _RerunAlias(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: Tensor, x: Tensor, sink: GradSink | None) -> Tensor:
        ctx.sink = sink
        return x.detach()  # same storage, new tensor object

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:
        sink: GradSink | None = ctx.sink
        if sink is not None:
            sink.grad = grad if sink.grad is None else sink.grad + grad
        return None, None, None


def rerun_alias(x: Tensor, sink: GradSink | None = None) -> Tensor:
    """A tensor on x's storage for a recompute; requires grad iff x does (or a sink is given)."""
    differentiable = x.is_floating_point() or x.is_complex()
    if not differentiable or not (x.requires_grad or sink is not None):
        return x.detach()
    with torch.enable_grad():
        return _RerunAlias.apply(_ANCHOR, x.detach(), sink)
