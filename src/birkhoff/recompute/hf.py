"""HuggingFace drop-in: `birkhoff.recompute.checkpoint` as a transformers model's checkpointing.

    import birkhoff.recompute.hf
    birkhoff.recompute.hf.enable(model, reclaim="safe")  # not activation_checkpointing_enable()

`enable` sets each decoder layer's `gradient_checkpointing` flag and checkpoint function through
the model's own `_set_gradient_checkpointing`, so every layer transformers would checkpoint is
checkpointed (labelled "model.layers.3", ...) and `activation_checkpointing_disable()` undoes it.
The model is duck-typed: transformers is not imported here. Details: docs/recompute.md.
Left out: checkpointing anything transformers would not (embeddings, heads).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from birkhoff.recompute.checkpoint import RECLAIM_MODES, Reclaim, checkpoint, default_label


def _layer_of(fn: Callable[..., Any]) -> nn.Module | None:
    """The module a transformers checkpoint call runs: partial(forward, layer) or bound method."""
    while isinstance(fn, functools.partial):
        if fn.args and isinstance(fn.args[0], nn.Module):
            return fn.args[0]
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else fn if isinstance(fn, nn.Module) else None


class LayerCheckpoint:
    """The `_gradient_checkpointing_func` `enable` installs: labels calls by layer name."""

    def __init__(self, names: dict[int, str], reclaim: Reclaim) -> None:
        self.names, self.reclaim = names, reclaim  # names: id(module) -> qualified name

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if kwargs:  # torch.utils.checkpoint options (use_reentrant, ...) have no meaning here
            raise ValueError(
                f"birkhoff.recompute.hf checkpoint got options {sorted(kwargs)}; pass none"
            )
        layer = _layer_of(fn)
        name = self.names.get(id(layer)) if layer is not None else None
        return checkpoint(fn, *args, reclaim=self.reclaim, name=name or default_label(fn))


def enable(model: nn.Module, *, reclaim: Reclaim = "safe") -> None:
    """Checkpoint every layer transformers checkpoints, with `birkhoff.recompute.checkpoint`."""
    if reclaim not in RECLAIM_MODES:
        raise ValueError(f"reclaim={reclaim!r} is invalid: expected one of {RECLAIM_MODES}")
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"model={type(model).__name__} does not support gradient checkpointing "
            "(supports_gradient_checkpointing is not True)"
        )
    names = {id(m): n for n, m in model.named_modules()}
    model._set_gradient_checkpointing(  # type: ignore[operator]
        enable=True, gradient_checkpointing_func=LayerCheckpoint(names, reclaim)
    )
