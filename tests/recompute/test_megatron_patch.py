"""The megatron-core backward on CPU, against megatron's own structure (no megatron needed).

`MegatronStyle` is megatron-core 0.19.2's `CheckpointFunction.forward` (without the tensor-
parallel split); `random` stands in for `megatron.core.tensor_parallel.random` with CPU RNG only.
Megatron's own backward (detach_variable leaves, `.grad`) is the reference: the patched one gives
identical gradients, and a stashed recomputed tensor pins neither the input nor a gradient.
The real model runs in test_megatron_gpu.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import detach_variable

from birkhoff.recompute import UseAfterFreeError, sanitize, track_saved_storages
from birkhoff.recompute.megatron import make_backward


@contextlib.contextmanager
def _fork_rng() -> Iterator[None]:
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


RANDOM = SimpleNamespace(
    _set_checkpointing=lambda: None, _unset_checkpointing=lambda: None, _fork_rng=_fork_rng,
    _set_all_rng_states=lambda cpu: torch.set_rng_state(cpu),
)  # fmt: skip


def megatron_backward(ctx: Any, *args: Tensor) -> tuple:
    """megatron-core 0.19.2 CheckpointFunction.backward, CPU RNG only."""
    inputs = ctx.saved_tensors
    with _fork_rng():
        torch.set_rng_state(ctx.rng_states[0])
        detached_inputs = detach_variable(inputs)
        with torch.enable_grad():
            outputs = ctx.run_function(*detached_inputs)
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    pairs = [(o, g) for o, g in zip(outputs, args, strict=True) if o.requires_grad]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return (None, None, *(inp.grad for inp in detached_inputs))


def function_class(backward: Any) -> type[torch.autograd.Function]:
    class MegatronStyle(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, run_function: Any, distribute: bool, *args: Tensor) -> Any:
            ctx.run_function, ctx.distribute_saved_activations = run_function, distribute
            ctx.rng_states = (torch.get_rng_state(),)
            with torch.no_grad():
                outputs = run_function(*args)
            ctx.save_for_backward(*args)
            return outputs

    MegatronStyle.backward = staticmethod(backward)  # type: ignore[method-assign]
    return MegatronStyle


VARIANTS = {
    "megatron": function_class(megatron_backward),
    "safe": function_class(make_backward(RANDOM, "safe")),
    "always": function_class(make_backward(RANDOM, "always")),
}


class Layer(nn.Module):
    """Dropout (RNG replay) and a stash of recomputed tokens, as MoE dispatchers keep."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32, dtype=torch.float64)
        self.routed: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        self.routed = x[:, :4] * 2.0
        return x + torch.dropout(torch.tanh(self.proj(x)), 0.1, train=True)


def run(variant: str | None, layers: nn.ModuleList) -> tuple[list[Tensor], StorageWeakRef, Any]:
    torch.manual_seed(0)
    leaf = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    layers.zero_grad(set_to_none=True)
    h = leaf * 1.0
    first = StorageWeakRef(h.untyped_storage())
    for layer in layers:
        h = layer(h) if variant is None else VARIANTS[variant].apply(layer, False, h)
    h.square().sum().backward()
    del h
    grads = [leaf.grad] + [p.grad for p in layers.parameters()]
    stash_leaf = layers[1].routed.grad_fn.next_functions[0][0].next_functions[0][0]
    return grads, first, getattr(stash_leaf, "variable", None)


def test_patched_backward_is_exact_and_pins_nothing() -> None:
    torch.manual_seed(1)
    layers = nn.ModuleList([Layer(), Layer()])
    ref, _, _ = run(None, layers)
    mega, mega_storage, mega_leaf = run("megatron", layers)
    safe, safe_storage, safe_leaf = run("safe", layers)
    for r, m, s in zip(ref, mega, safe, strict=True):
        assert torch.equal(r, m) and torch.equal(r, s)
    # megatron: layer 1's stash reaches its input leaf, so that storage and its .grad live on
    assert mega_leaf is not None and mega_leaf.grad is not None
    # patched: the stash's graph ends at the 0-byte anchor; layer 1's input storage died
    assert safe_leaf is None or safe_leaf.numel() == 0
    assert safe_storage.expired()
    del mega_storage


def test_always_frees_under_a_pending_reader() -> None:
    """The seed bug in megatron form: the input is also saved by a node outside (sin)."""
    layer = Layer()
    with sanitize(), pytest.raises(UseAfterFreeError):
        with track_saved_storages():
            h = torch.randn(16, 32, dtype=torch.float64, requires_grad=True) * 1.0
            reader = h.sin()  # created first, so its backward runs after the checkpoint's
            out = VARIANTS["always"].apply(layer, False, h)
            loss = out.sum() + reader.sum()
        loss.backward()
