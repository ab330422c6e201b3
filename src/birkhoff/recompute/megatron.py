"""megatron-core drop-in: a `CheckpointFunction.backward` that pins nothing and frees nothing.

    import birkhoff.recompute.megatron as bm
    bm.patch()        # once, before training; bm.unpatch() restores megatron's own backward

`patch(mode="safe")` installs megatron's reentrant backward unchanged except that the rerun's
inputs are `rerun_alias` tensors (rerun.py): the input gradient lands in a `GradSink` emptied
when handed back, and a tensor an MoE layer stashes reaches only a 0-byte anchor. Nothing is
freed; `mode="always"` reproduces the RL stacks' unconditional `resize_(0)` for comparisons.
megatron is imported only when `patch` is called. Why the stock and stacks' backward pin or
corrupt memory: docs/recompute.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from birkhoff.recompute.registry import free_storage, storage_key
from birkhoff.recompute.rerun import GradSink, rerun_alias

MODES = ("safe", "always")
_ORIGINAL: dict[str, Any] = {}


def _rerun(random: ModuleType, ctx: Any, sinks: list[GradSink | None]) -> tuple:
    """Rerun the checkpointed function on aliases of the saved inputs with the forward's RNG."""
    inputs = ctx.saved_tensors
    if ctx.distribute_saved_activations:
        random.safely_set_viewless_tensor_data(
            inputs[0], random.gather_split_1d_tensor(inputs[0].data).view(ctx.input_0_shape)
        )
    with random._fork_rng():
        random._set_all_rng_states(*ctx.rng_states)
        aliases = [
            rerun_alias(x, s) if isinstance(x, Tensor) else x
            for x, s in zip(inputs, sinks, strict=True)
        ]
        with torch.enable_grad():
            outputs = ctx.run_function(*aliases)
    return (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)


def make_backward(random: ModuleType, mode: str = "safe") -> Callable[..., tuple]:
    """`CheckpointFunction.backward` for megatron's `tensor_parallel.random` module `random`."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: expected one of {MODES}")

    def backward(ctx: Any, *grads: Tensor) -> tuple:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "Checkpointing is not compatible with .grad(), please use .backward() if possible"
            )
        random._set_checkpointing()
        sinks = [
            GradSink() if isinstance(x, Tensor) and x.requires_grad else None
            for x in ctx.saved_tensors
        ]
        outputs = _rerun(random, ctx, sinks)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=False)
            if isinstance(o, Tensor) and o.requires_grad
        ]
        del outputs
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        del pairs
        input_grads = tuple(s.take() if s is not None else None for s in sinks)
        if mode == "always":
            for x in ctx.saved_tensors:
                if isinstance(x, Tensor) and storage_key(x) is not None:
                    free_storage(x)
        random._unset_checkpointing()
        return (None, None, *input_grads)

    return backward


def patch(mode: str = "safe") -> None:
    """Replace megatron-core's `CheckpointFunction.backward` (idempotent; `unpatch` restores)."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    cls = random.CheckpointFunction
    _ORIGINAL.setdefault("backward", cls.__dict__["backward"])
    cls.backward = staticmethod(make_backward(random, mode))


def unpatch() -> None:
    """Restore megatron-core's own `CheckpointFunction.backward`."""
    if "backward" in _ORIGINAL:
        random = importlib.import_module("megatron.core.tensor_parallel.random")
        random.CheckpointFunction.backward = _ORIGINAL.pop("backward")
