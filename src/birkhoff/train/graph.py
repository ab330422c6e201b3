"""The training step's forward, loss and backward replayed from one CUDA graph per batch shape.

`StepGraphs` captures forward + loss + backward once per batch shape (a tuple of tensors, checked
and copied into the graph's static inputs on each call) and replays it with one launch, so the
step runs at the device's pace; clipping, the optimizer step and the metrics' host reads stay
eager (`train_step`). `.grad` must be None before a call, and a call's loss, metrics and
gradients are valid until the next call. Graphs share one memory pool, at most `max_graphs` are
kept, and all are captured again when a weight moves.
Left out: graphing the optimizer step, GRPO updates (their batches change shape every step),
data parallel, recompute (a replay runs no Python hooks). Design: docs/training.md.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from birkhoff.config import ModelConfig
from birkhoff.model.transformer import check_token_ids, token_values_unchecked
from birkhoff.runtime.distributed import world_size
from birkhoff.train.config import TrainConfig
from birkhoff.train.step import LossFn, Metrics, forward_context, model_device

LENGTH_BUCKET = 64  # the supervised loop pads T to a multiple of this (train/loop.py)
Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def bucketed_length(num_tokens: int, cap: int) -> int:
    """`num_tokens` rounded up to a multiple of LENGTH_BUCKET, but at most `cap` (the model's
    max_seq_len; num_tokens <= cap)."""
    return min(-(-num_tokens // LENGTH_BUCKET) * LENGTH_BUCKET, max(cap, num_tokens))


def field_names(batch: tuple[object, ...]) -> list[str]:
    """A NamedTuple's field names, or a plain tuple's positions as strings."""
    return list(getattr(batch, "_fields", None) or map(str, range(len(batch))))


def batch_signature(batch: tuple[object, ...]) -> Signature:
    """(shape, dtype) of every field of `batch`; ValueError for a field that is not a tensor."""
    if not isinstance(batch, tuple):
        raise ValueError(f"a graphed step takes a tuple of tensors; got {type(batch).__name__}")
    signature = []
    for name, value in zip(field_names(batch), batch, strict=True):
        if not isinstance(value, Tensor):
            raise ValueError(
                f"batch field {name!r} is a {type(value).__name__}, not a tensor: a CUDA graph "
                "would replay the value it was captured with"
            )
        signature.append((tuple(value.shape), value.dtype))
    return tuple(signature)


def token_ids_check(model: nn.Module) -> Callable[[tuple[Tensor, ...]], None]:
    """The default `check_batch`: every int32/int64 field of a batch holds token ids of `model`."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig):
        raise ValueError("a model without a ModelConfig .cfg needs an explicit check_batch")

    def check(batch: tuple[Tensor, ...]) -> None:
        for name, x in zip(field_names(batch), batch, strict=True):
            if x.dtype in (torch.int32, torch.int64):
                check_token_ids(
                    x, name=name, vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len
                )

    return check


WeightSlots = list[tuple[Mapping[str, Tensor | None], str]]


def weight_slots(model: nn.Module) -> WeightSlots:
    """Where each parameter and buffer of `model` is registered: (its module's `_parameters`
    or `_buffers` dict, its name). Built once: walking the modules on every call costs far
    more than reading these slots (docs/training.md)."""
    return [
        (registry, name)
        for module in model.modules()
        for registry in (module._parameters, module._buffers)
        for name in registry
    ]


def weight_addresses(slots: WeightSlots) -> list[int]:
    """The data address of the tensor in each slot (0 for an empty one): a `p.data = t`, a
    parameter replaced in its module or a buffer reassigned all change it."""
    return [0 if (t := registry[name]) is None else t.data_ptr() for registry, name in slots]


@contextlib.contextmanager
def _syncs_fail() -> Iterator[None]:
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]  # static copies of the batch
    loss: Tensor
    metrics: dict[str, Tensor]
    grads: list[tuple[nn.Parameter, Tensor]]  # each parameter's gradient in the graph's pool


class StepGraphs:
    """Forward + `loss_fn` + backward of `model`, captured per batch signature and replayed."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        cfg: TrainConfig,
        *,
        num_warmup: int = 3,
        max_graphs: int = 4,
        check_batch: Callable[[tuple[Tensor, ...]], None] | None = None,
    ) -> None:
        device = model_device(model)
        if device.type != "cuda":
            raise ValueError(f"cuda_graph needs a CUDA model; the model is on {device}")
        if cfg.recompute != "none":
            raise ValueError(f"cuda_graph needs recompute='none'; got {cfg.recompute!r}")
        if world_size() > 1:
            raise ValueError(f"cuda_graph runs in one process; the world size is {world_size()}")
        if num_warmup < 1 or max_graphs < 1:
            raise ValueError(f"num_warmup={num_warmup}, max_graphs={max_graphs}: both must be >= 1")
        self.model, self.loss_fn, self.cfg = model, loss_fn, cfg
        self.num_warmup, self.max_graphs = num_warmup, max_graphs
        self.check_batch = check_batch or token_ids_check(model)
        self.graphs: OrderedDict[Signature, _Graph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()  # shared by every capture (docstring)
        self.slots = weight_slots(model)
        self.params: list[nn.Parameter] = []
        self.addresses: list[int] = []

    def _track_weights(self) -> None:
        """Drop every graph when a parameter or buffer no longer lives where the graphs read
        it (replaced, not copied into: a loaded state dict copies, `p.data = t` moves)."""
        addresses = weight_addresses(self.slots)
        if addresses != self.addresses:
            self.graphs.clear()
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            self.addresses = addresses

    def __call__(self, batch: tuple[Tensor, ...]) -> tuple[Tensor, Metrics]:
        """(loss, metrics) of `batch`, gradients in `.grad`: all valid until the next call."""
        key = batch_signature(batch)
        self.check_batch(batch)
        self._track_weights()
        held = [p for p in self.params if p.grad is not None]
        if held:
            raise ValueError(
                f"{len(held)} parameters hold a gradient: a graphed step writes fresh gradients "
                "(zero_grad(set_to_none=True) first; no accumulation)"
            )
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(batch, key)
        self.graphs.move_to_end(key)
        for static, x in zip(entry.inputs, batch, strict=True):
            static.copy_(x, non_blocking=True)
        entry.graph.replay()
        for p, grad in entry.grads:
            p.grad = grad
        return entry.loss, dict(entry.metrics)

    def _forward_backward(self, batch: tuple[Tensor, ...]) -> tuple[Tensor, Metrics]:
        with token_values_unchecked(), forward_context(self.model, self.cfg):
            loss, metrics = self.loss_fn(self.model, batch)
        loss.backward()
        return loss.detach(), metrics

    def _capture(self, batch: tuple[Tensor, ...], key: Signature) -> _Graph:
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)  # its memory goes back to the shared pool
        device = model_device(self.model)
        copies = [x.to(device, copy=True) for x in batch]
        inputs = type(batch)(*copies) if hasattr(batch, "_fields") else tuple(copies)
        shapes = [s for s, _ in key]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for i in range(self.num_warmup):
                try:
                    with _syncs_fail() if i == self.num_warmup - 1 else contextlib.nullcontext():
                        self._forward_backward(inputs)
                except RuntimeError as err:
                    if "synchroniz" not in str(err):  # not sync debug mode's: the step's own
                        raise
                    raise RuntimeError(
                        f"cuda_graph: the step for batch shapes {shapes} syncs with the host "
                        f"({err}); a CUDA graph cannot capture it: train with cuda_graph=False"
                    ) from err
                finally:
                    for p in self.params:
                        p.grad = None
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-up's blocks are cached for the side stream only
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                loss, metrics = self._forward_backward(inputs)
            grads = [(p, p.grad) for p in self.params if p.grad is not None]
        except RuntimeError as err:
            raise RuntimeError(
                f"cuda_graph: capturing the step for batch shapes {shapes} failed ({err})"
            ) from err
        finally:
            for p in self.params:
                p.grad = None
        stale = [name for name, value in metrics.items() if not isinstance(value, Tensor)]
        if stale:
            raise ValueError(f"metrics {stale} are not tensors: a graph cannot update them")
        entry = _Graph(graph, inputs, loss, metrics, grads)  # type: ignore[arg-type]
        self.graphs[key] = entry
        return entry
