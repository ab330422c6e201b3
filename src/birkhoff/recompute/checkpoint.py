"""Activation recompute that saves only a function's inputs, with optional early reclaim.

`checkpoint(fn, *args, reclaim=...)` runs `fn` without building a graph, keeps only its inputs,
and in backward reruns `fn` with the forward's CPU and CUDA RNG states and autocast settings,
then backpropagates through the rerun (parameter gradients accumulate into `.grad`, input
gradients are returned). After that, an input's storage may be reclaimed:
- "never": the inputs are just dropped (plain recompute);
- "always": every input storage is freed at once, whoever still reads it. This is the
  unconditional `untyped_storage().resize_(0)` that corrupts mHC + MTP; it is kept only to
  reproduce that bug in tests and benchmarks;
- "safe": the storage is freed only if the forward allocated it (not a parameter, buffer or user
  input) and once no pending autograd node holds a saved tensor on it (see registry.py). Until
  then the checkpoint just drops its reference, and the last reader frees it. Needs the forward
  to run inside `track_saved_storages()`.

Design choices:
- A `torch.autograd.Function` with reentrant backward, written here rather than wrapping
  `torch.utils.checkpoint`, so the inputs are held by registry holders (counted as readers)
  and the reclaim decision sees them.
- The recompute runs with identity saved-tensor hooks and allocation recording paused, so a
  backward run inside a tracking context does not register its own temporaries.
Left out: `torch.autograd.grad` with respect to parameters used inside `fn` and
`retain_graph=True` (both need the reentrant backward to keep inputs; a second backward raises).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

from birkhoff.recompute.registry import (
    SavedRef,
    StorageRegistry,
    active_recorder,
    active_registry,
    free_storage,
    storage_key,
)

Reclaim = Literal["safe", "always", "never"]
# An input that always requires grad, so the outputs do even when only parameters used inside
# `fn` (and no input) require grad; it receives no gradient.
_GRAD_ANCHOR = torch.empty(0, requires_grad=True)
RECLAIM_MODES = ("safe", "always", "never")


@dataclass(frozen=True, kw_only=True, slots=True)
class _Spec:
    fn: Callable[..., Any]
    reclaim: Reclaim
    label: str
    registry: StorageRegistry


@dataclass(frozen=True, kw_only=True, slots=True)
class _RngAutocast:
    """What the rerun must reproduce: RNG states and autocast settings of the forward."""

    cpu_rng: Tensor
    cuda_rng: dict[int, Tensor]
    autocast: tuple[tuple[str, bool, torch.dtype], ...]

    @staticmethod
    def capture(args: Sequence[object]) -> _RngAutocast:
        devices = sorted({a.device.index or 0 for a in args if isinstance(a, Tensor) and a.is_cuda})
        cuda_rng = {d: torch.cuda.get_rng_state(d) for d in devices}
        autocast = tuple(
            (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
            for dt in ("cpu", "cuda")
        )
        return _RngAutocast(cpu_rng=torch.get_rng_state(), cuda_rng=cuda_rng, autocast=autocast)

    @contextlib.contextmanager
    def restore(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=list(self.cuda_rng)), contextlib.ExitStack() as stack:
            torch.set_rng_state(self.cpu_rng)
            for device, state in self.cuda_rng.items():
                torch.cuda.set_rng_state(state, device)
            for device_type, enabled, dtype in self.autocast:
                if enabled or device_type == "cpu" or torch.cuda.is_available():
                    stack.enter_context(
                        torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled)
                    )
            yield


def _as_tuple(out: Any, label: str) -> tuple[Tensor, ...]:
    outs = out if isinstance(out, tuple) else (out,)
    if not outs or not all(isinstance(o, Tensor) for o in outs):
        kinds = [type(o).__name__ for o in outs]
        raise TypeError(
            f"checkpoint {label!r}: fn must return a tensor or a tuple of tensors, got {kinds}"
        )
    return outs


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: _Spec, anchor: Tensor, *args: Any) -> Any:
        ctx.spec, ctx.rng = spec, _RngAutocast.capture(args)
        # Inputs are held as registry holders (not save_for_backward): they count as pending
        # readers of their storage until this node's backward drops them.
        ctx.refs = [spec.registry.pack(a) if isinstance(a, Tensor) else a for a in args]
        ctx.input_requires_grad = [isinstance(a, Tensor) and a.requires_grad for a in args]
        # Leaves that require grad are parameters or user inputs even when created inside the
        # forward (lazy initialisation): never reclaimed, whatever the registry says.
        ctx.reclaimable = [
            isinstance(a, Tensor) and not (a.is_leaf and a.requires_grad) for a in args
        ]
        with torch.no_grad():
            out = spec.fn(*args)
        outs = _as_tuple(out, spec.label)
        input_keys = {storage_key(a) for a in args if isinstance(a, Tensor)}
        for o in outs:
            if not o._is_view() and storage_key(o) not in input_keys:
                spec.registry.record_allocation(o)
        ctx.single = not isinstance(out, tuple)
        return outs[0] if ctx.single else outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        spec: _Spec = ctx.spec
        refs, ctx.refs = ctx.refs, None
        if refs is None:
            raise RuntimeError(
                f"checkpoint {spec.label!r}: backward ran twice; recompute does not keep its "
                "inputs for retain_graph=True"
            )
        inputs = [_detached_input(r, g) for r, g in zip(refs, ctx.input_requires_grad, strict=True)]
        saved_keys: set[int] = set()
        with _rerun_hooks(saved_keys), ctx.rng.restore(), torch.enable_grad():
            outs = _as_tuple(spec.fn(*inputs), spec.label)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
        _free_unsaved_outputs(outs, saved_keys, inputs)
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [x.grad if isinstance(x, Tensor) else None for x in inputs]
        del inputs, outs, pairs
        _reclaim(spec, [r for r, ok in zip(refs, ctx.reclaimable, strict=True) if ok])
        del refs  # the last holder of a marked storage frees it (registry.release)
        return (None, None, *input_grads)


def _detached_input(ref: Any, requires_grad: bool) -> Any:
    if not isinstance(ref, SavedRef):
        return ref
    x = ref.unpack().detach()
    return x.requires_grad_(requires_grad)


def _reclaim(spec: _Spec, refs: list[SavedRef]) -> None:
    if spec.reclaim == "always":
        for ref in refs:
            if ref.tensor.untyped_storage().nbytes() > 0:
                spec.registry.free(ref.tensor, spec.label)
    elif spec.reclaim == "safe":
        for ref in refs:
            spec.registry.request_reclaim(ref, spec.label)


@contextlib.contextmanager
def _rerun_hooks(saved_keys: set[int]) -> Iterator[None]:
    """Saved-tensor hooks of the rerun: note which storages its nodes save, and nothing else.

    They also keep the rerun out of an active tracking context (its hooks and recording).
    """

    def pack(t: Tensor) -> Tensor:
        key = storage_key(t)
        if key is not None:
            saved_keys.add(key)
        return t

    registry = active_registry()
    if registry is not None:
        registry.record_paused += 1
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
            yield
    finally:
        if registry is not None:
            registry.record_paused -= 1


def _identity(x: Any) -> Any:
    return x


def _free_unsaved_outputs(outs: tuple[Tensor, ...], saved_keys: set[int], inputs: list) -> None:
    """Free rerun outputs no node saved: backward needs only their grad_fn, not their data.

    torch.utils.checkpoint (non-reentrant) gets the same saving by stopping the rerun early.
    """
    keep = saved_keys | {storage_key(x) for x in inputs if isinstance(x, Tensor)}
    for o in outs:
        if not o._is_view() and storage_key(o) not in keep:
            free_storage(o)


@contextlib.contextmanager
def _recording_paused(registry: StorageRegistry) -> Iterator[None]:
    """Pop the allocation recorder around a checkpointed fn (it records the outputs itself)."""
    recorder = active_recorder()
    if recorder is not None and _get_current_dispatch_mode() is recorder:
        with _pop_mode_temporarily():
            yield
        return
    registry.record_paused += 1
    try:
        yield
    finally:
        registry.record_paused -= 1


def checkpoint(
    fn: Callable[..., Any], *args: Any, reclaim: Reclaim = "safe", name: str | None = None
) -> Any:
    """Run `fn(*args)` saving only `args`; rerun it in backward; see the module docstring.

    Returns what `fn` returns (a tensor or a tuple of tensors). `name` labels the checkpoint in
    errors (default: `fn.__qualname__`).
    """
    if reclaim not in RECLAIM_MODES:
        raise ValueError(f"reclaim={reclaim!r} is invalid: expected one of {RECLAIM_MODES}")
    label = name or str(getattr(fn, "__qualname__", type(fn).__name__))
    if not torch.is_grad_enabled():
        return fn(*args)
    registry = active_registry()
    if registry is None:
        if reclaim == "safe":
            raise RuntimeError(
                f"checkpoint {label!r} uses reclaim='safe', which needs the forward to run "
                "inside birkhoff.recompute.track_saved_storages(): wrap the forward pass (the "
                "code that builds the graph, not the backward) in `with track_saved_storages():`"
            )
        registry = StorageRegistry()  # private: holds this checkpoint's inputs only
    spec = _Spec(fn=fn, reclaim=reclaim, label=label, registry=registry)
    with _recording_paused(registry):
        return _Checkpoint.apply(spec, _GRAD_ANCHOR, *args)
