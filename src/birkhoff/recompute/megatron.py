"""megatron-core drop-in: a `CheckpointFunction.backward` that pins nothing and frees nothing.

    import birkhoff.recompute.megatron as bm
    bm.patch()        # once, before training; bm.unpatch() restores megatron's own backward

megatron-core's `tensor_parallel.random.CheckpointFunction` (full recompute of transformer
layers and of MTP layers) is reentrant: backward reruns the function on
`detach_variable(inputs)`, leaves that require grad, backpropagates through the rerun and
returns the leaves' `.grad`. An MoE layer that stashes a recomputed tensor on `self` keeps, via
that tensor's graph, the leaf (the input's whole storage) and its `.grad` alive until the next
step. RL stacks patch the backward to `untyped_storage().resize_(0)` every input afterwards,
which also frees storage that other pending nodes read: MTP's input is the decoder output that
the final layer norm saved, and MTP's backward runs first.

`patch(mode="safe")` installs `make_backward(random)`: the same backward (RNG tracker states,
`distribute_saved_activations`, the checkpointing flag, `_is_checkpoint_valid`) except that the
rerun's inputs are `rerun_alias(x, sink)` tensors (see rerun.py): the input gradient lands in a
`GradSink` that is emptied when it is handed back, and a stashed tensor's graph reaches only a
0-byte anchor. Nothing is freed; each storage dies with its last holder. `mode="always"`
reproduces the stacks' unconditional free (for comparisons and the sanitizer only).
megatron is imported only when `patch` is called.
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
