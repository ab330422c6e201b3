"""Activation recompute: tensors saved inside `fn` become slots that a rerun fills in backward.

`checkpoint(fn, *args, reclaim=..., name=...)` runs fn with autograd on under saved-tensor hooks
that hand every node an empty slot; the first unpack in backward reruns fn with the forward's RNG
and autocast state and fills the live slots (as `torch.utils.checkpoint`'s non-reentrant mode,
written out so the checkpoint's own references are explicit). `reclaim` says when it drops its
references to its inputs: "never" (with its last node), "safe" (right after the rerun; frees
nothing someone else holds) or "always" (resize_(0) of every input storage: the unconditional
free that corrupts mHC + MTP, kept to reproduce that bug). Ownership rules: docs/recompute.md.
Left out: nested checkpoints rerun the inner one inside the outer rerun (correct, not minimal);
fn must save the same tensors on the rerun as in the forward.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from birkhoff.recompute.registry import StorageRegistry, active_registry, storage_key
from birkhoff.recompute.rerun import rerun_alias

Reclaim = Literal["safe", "always", "never"]
RECLAIM_MODES = ("safe", "always", "never")


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


class _Slot:
    """What a node inside the checkpoint saves instead of a tensor; the rerun fills it."""

    __slots__ = ("index", "value", "__weakref__")

    def __init__(self, index: int) -> None:
        self.index = index
        self.value: Tensor | None = None


class _StopRerun(Exception):
    """Raised by the rerun's pack hook once the last live slot is filled."""


class _Frame:
    """One checkpoint call: fn, its inputs, the forward's RNG state and its slots."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple,
        reclaim: Reclaim,
        label: str,
        registry: StorageRegistry | None,
    ) -> None:
        self.fn, self.reclaim, self.label, self.registry = fn, reclaim, label, registry
        self.inputs: tuple | None = args
        self.versions = [a._version if isinstance(a, Tensor) else None for a in args]
        self.state = _RngAutocast.capture(args)
        self.slots: list[weakref.ref[_Slot]] = []
        self.metas: list[tuple[torch.Size, torch.dtype, torch.device]] = []

    def pack(self, t: Tensor) -> _Slot:
        slot = _Slot(len(self.slots))
        self.slots.append(weakref.ref(slot))
        self.metas.append((t.shape, t.dtype, t.device))
        return slot

    def unpack(self, slot: _Slot) -> Tensor:
        if slot.value is None:
            self.rerun()
        value, slot.value = slot.value, None
        assert value is not None, f"checkpoint {self.label!r}: slot {slot.index} was not refilled"
        return value

    def rerun(self) -> None:
        if self.inputs is None:
            raise RuntimeError(
                f"checkpoint {self.label!r}: backward reached it a second time, but "
                f"reclaim={self.reclaim!r} released its inputs after the first rerun; use "
                "reclaim='never' to backward twice (retain_graph=True)"
            )
        live = [
            i for i, ref in enumerate(self.slots) if (s := ref()) is not None and s.value is None
        ]
        if not live:
            return
        self.check_versions()
        filler = _Filler(self, last=live[-1])
        with contextlib.ExitStack() as stack:
            if self.registry is not None:
                stack.enter_context(self.registry.recording_paused())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(filler.pack, _no_unpack))
            stack.enter_context(self.state.restore())
            stack.enter_context(torch.enable_grad())
            args = tuple(rerun_alias(a) if isinstance(a, Tensor) else a for a in self.inputs)
            with contextlib.suppress(_StopRerun):
                self.fn(*args)
            del args
        if filler.count <= live[-1]:
            raise RuntimeError(
                f"checkpoint {self.label!r}: the rerun saved {filler.count} tensors, the forward "
                f"{len(self.slots)}; fn must do the same work when it is recomputed"
            )
        if self.reclaim == "safe":
            self.release_inputs()

    def check_versions(self) -> None:
        assert self.inputs is not None
        for i, (a, version) in enumerate(zip(self.inputs, self.versions, strict=True)):
            if isinstance(a, Tensor) and a._version != version:
                raise RuntimeError(
                    f"checkpoint {self.label!r}: input {i} was modified in place after the "
                    f"forward (version {a._version}, expected {version}); the rerun would "
                    "compute something else"
                )

    def release_inputs(self) -> None:
        """Drop the references to the inputs; record them so the census can tell what died."""
        inputs, self.inputs = self.inputs, None
        if self.registry is not None and inputs is not None:
            for a in inputs:
                if isinstance(a, Tensor):
                    self.registry.note_released(a, self.label)

    def free_inputs(self) -> None:
        """reclaim="always": resize every input storage to 0 bytes, whoever still holds it."""
        if self.reclaim != "always" or self.inputs is None:
            return
        inputs, self.inputs = self.inputs, None  # freed once: the hook or the frame's death
        registry = self.registry or StorageRegistry()
        for a in inputs:
            has_bytes = isinstance(a, Tensor) and storage_key(a) is not None
            if has_bytes and a.untyped_storage().nbytes() > 0:
                registry.free(a, self.label)

    def __del__(self) -> None:
        # A checkpoint none of whose inputs needs a gradient has no boundary node to hook
        # (_free_after_backward): its frame dies with its last node, after its backward ran.
        self.free_inputs()


class _Filler:
    """Pack hook of the rerun: fills the frame's live slots in order, then stops the rerun."""

    def __init__(self, frame: _Frame, last: int) -> None:
        self.frame_ref = weakref.ref(frame)  # the rerun graph must not keep the frame alive
        self.last, self.count = last, 0

    def pack(self, t: Tensor) -> None:
        frame = self.frame_ref()
        assert frame is not None
        index, self.count = self.count, self.count + 1
        if index >= len(frame.slots):
            raise RuntimeError(
                f"checkpoint {frame.label!r}: the rerun saves more tensors than the forward "
                f"({len(frame.slots)}); fn must do the same work when it is recomputed"
            )
        meta = (t.shape, t.dtype, t.device)
        if meta != frame.metas[index]:
            raise RuntimeError(
                f"checkpoint {frame.label!r}: saved tensor {index} is {meta} on the rerun but "
                f"was {frame.metas[index]} in the forward; fn must be deterministic"
            )
        slot = frame.slots[index]()
        if slot is not None and slot.value is None:
            slot.value = t.detach()  # no grad_fn: the rerun graph stays out of the slot
        if index == self.last:
            raise _StopRerun


def _no_unpack(_: Any) -> Tensor:
    raise RuntimeError(
        "backward through a graph built while recomputing a checkpoint: its nodes keep no "
        "saved tensors (use the checkpoint's outputs, not values stashed during the rerun)"
    )


def _checkpoint_outputs(registry: StorageRegistry, out: Any, args: tuple) -> None:
    """Note the outputs' storages as forward allocations (the recorder is paused inside fn)."""
    input_keys = {storage_key(a) for a in args if isinstance(a, Tensor)}
    for o in tree_leaves(out):
        if isinstance(o, Tensor) and not o._is_view() and storage_key(o) not in input_keys:
            registry.record_allocation(o)


def default_label(fn: Callable[..., Any]) -> str:
    """The name errors and the census use for a checkpoint of `fn`.

    A `functools.partial` names what it wraps; a module (or a partial binding one as the first
    argument, as transformers does with `partial(forward, layer, **kwargs)`) names its class.
    """
    bound: tuple = ()
    while isinstance(fn, functools.partial):
        bound = fn.args or bound
        fn = fn.func
    owner = getattr(fn, "__self__", None) or (bound[0] if bound else None)
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    name = str(getattr(fn, "__qualname__", type(fn).__name__))
    if isinstance(owner, nn.Module) and not name.startswith(type(owner).__name__):
        return f"{type(owner).__name__}.{name}"
    return name


def checkpoint(
    fn: Callable[..., Any], *args: Any, reclaim: Reclaim = "safe", name: str | None = None
) -> Any:
    """Run `fn(*args)` keeping only `args` (plus slots); rerun it in backward. See module doc.

    Returns whatever fn returns. `name` labels the checkpoint in errors and in the census
    (default: `default_label(fn)`). Tensors fn saves are tracked for the census and the
    sanitizer when the forward runs inside `track_saved_storages()`; reclaim needs no context.
    """
    if reclaim not in RECLAIM_MODES:
        raise ValueError(f"reclaim={reclaim!r} is invalid: expected one of {RECLAIM_MODES}")
    if not torch.is_grad_enabled():
        return fn(*args)
    registry = active_registry()
    frame = _Frame(fn, args, reclaim, name or default_label(fn), registry)
    with contextlib.ExitStack() as stack:
        if registry is not None:
            stack.enter_context(registry.recording_paused())
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack))
        out = fn(*args)
    if registry is not None:
        _checkpoint_outputs(registry, out, args)
    if reclaim == "always":
        _free_after_backward(frame, out, args)
    return out


def _free_after_backward(frame: _Frame, out: Any, args: tuple) -> None:
    """Free the inputs once every node of fn that hands a gradient to an input has run.

    That is the moment the seed's recompute freed them: right after the checkpoint's own
    backward, while nodes outside it (the output contraction) may still read the storage. A
    post-hook on those boundary nodes makes the moment independent of when Python drops the
    frame.
    """
    stops = {
        torch.autograd.graph.get_gradient_edge(a).node
        for a in args
        if isinstance(a, Tensor) and a.requires_grad
    }
    roots = [o.grad_fn for o in tree_leaves(out) if isinstance(o, Tensor) and o.grad_fn]
    boundary, seen = [], set(stops)
    while roots:
        node = roots.pop()
        if node in seen:
            continue
        seen.add(node)
        nexts = [n for n, _ in node.next_functions if n is not None]
        if any(n in stops for n in nexts):
            boundary.append(node)
        roots.extend(nexts)
    if not boundary:
        return
    frame_ref, pending = weakref.ref(frame), [len(boundary)]

    def done(*_: Any) -> None:
        pending[0] -= 1
        if pending[0] == 0 and (live := frame_ref()) is not None:
            live.free_inputs()

    for node in boundary:
        node.register_hook(done)
