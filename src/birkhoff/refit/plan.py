"""RefitPlan: one model's bucket layout, kept across refits so a refit only issues the copies.

A refit's host-side cost is per tensor (module traversal, grouping of fused parts, placement,
views, staging), while its device work is one `torch._foreach_copy_` per bucket. The plan is
recorded from a successful planless refit (`BucketPacker(record=True)`) and replays it: per
bucket, the source tensors in copy order and meta-device *templates* from which one
`unflatten_dense_tensors` call per dtype makes every destination view (the copies) and every
served view (the engine's tensors) of a bucket buffer; they are made once per bank (below), so
a replay runs no Python-level op per tensor.

Freshness: the sources are the Parameter/buffer objects themselves, never detached views, so a
replayed copy reads their current data (also after `param.data = new`). Before each replay,
`matches` checks in one pass what the layout depends on, and the caller records a new plan
on any difference: the model's config object, the identity and order of every module's
submodules, parameters and buffers (a replaced Parameter or module), every source's shape,
the engine manifest (names, shapes, dtypes), the bucket size, the device and the transport's
buffer mode. Source dtypes and devices need no check: the cast and the transfer are part of
the copy, and the entry dtype comes from the manifest.

Buffer ownership: replays write into reusable *banks* of bucket buffers (refit/bank.py), which
are never rewritten while the engine, a generation or a caller still holds their tensors.
fp8: a quantized weight is recorded as a recipe (its trainer Parameters) plus meta stand-ins
for its codes and scales (`QuantizedSources`); a replay quantizes each recipe from current
values, straight into the bank's views when both outputs land whole in buckets, else into a
temporary that the bucket copies slice.
Left out: detecting a persistent buffer re-registered as non-persistent under the same object.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.refit.bank import Banks
from birkhoff.refit.bucket import Bucket, BucketEntry, BucketPacker, Placed, _align
from birkhoff.refit.fp8 import quantize_parts

_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, RefitPlan] = weakref.WeakKeyDictionary()


def _template(shape: tuple[int, ...] | torch.Size) -> Tensor:
    return torch.empty(shape, device="meta")


def _templates(
    spans: list[tuple[int, int, tuple[int, ...] | torch.Size]], itemsize: int
) -> tuple[list[Tensor], list[int]]:
    """Templates for ascending (offset, nbytes, shape) spans of one dtype: gaps, then spans.

    Returns the templates and the index of each span's template among them.
    """
    templates: list[Tensor] = []
    where: list[int] = []
    pos = 0
    for offset, nbytes, shape in spans:
        assert offset % itemsize == 0 and offset >= pos, "spans must be aligned and ascending"
        if offset > pos:
            templates.append(_template(((offset - pos) // itemsize,)))
        where.append(len(templates))
        templates.append(_template(shape))
        pos = offset + nbytes
    return templates, where


class QuantizedSources:
    """The fp8 weights of a recording refit: their trainer parts, and meta stand-ins for codes.

    The packer records a stand-in (no memory) in place of each temporary code/scale tensor, and
    the plan turns it back into "output `o` of recipe `k`", recomputed from the parts on replay.
    """

    def __init__(self) -> None:
        self.parts: list[list[Tensor]] = []
        self.stand_ins: dict[int, tuple[int, int]] = {}  # id(stand-in) -> (recipe, output)

    def note(self, parts: list[Tensor], q: Tensor, scale_inv: Tensor) -> tuple[Tensor, Tensor]:
        """Register one quantized weight; returns the stand-ins for its codes and scales."""
        recipe = len(self.parts)
        self.parts.append(list(parts))
        stand_ins = (torch.empty_like(q, device="meta"), torch.empty_like(scale_inv, device="meta"))
        for output, stand_in in enumerate(stand_ins):
            self.stand_ins[id(stand_in)] = (recipe, output)
        return stand_ins


@dataclass(slots=True)
class _Group:
    """The spans of one dtype in a bucket."""

    dtype: torch.dtype
    copy_templates: list[Tensor]
    copy_where: list[int]
    served_templates: list[Tensor]
    served_where: list[int]
    served_entries: list[int]  # index in the bucket's entries of each served view
    # fp8 outputs quantized straight into the bucket: (recipe, output, index in copy templates)
    direct: list[tuple[int, int, int]]


@dataclass(slots=True)
class _PlannedBucket:
    entries: list[BucketEntry]
    nbytes: int
    alloc: int  # nbytes rounded up so that every dtype can view the whole allocation
    groups: list[_Group]
    # in copy order (group by group, ascending offset); a meta stand-in where `derived` fills in
    sources: list[Tensor]
    chunks: list[tuple[int, Tensor, int, int]]  # (index in sources, part, start, count)
    # (index in sources, recipe, output, start, count or None for the whole output)
    derived: list[tuple[int, int, int, int, int | None]]
    release: list[int]  # recipes whose outputs no later bucket carries
    quantize_now: list[int]  # direct recipes whose first output lands in this bucket


def _is_whole(c: Placed) -> bool:
    return not c.start and c.nbytes == c.part.numel() * c.dtype.itemsize


def _direct_recipes(
    closed: list[tuple[list[BucketEntry], list[Placed], int]],
    stand_ins: Mapping[int, tuple[int, int]],
    *,
    adopts: bool,
) -> dict[int, int]:
    """Recipes whose codes and scales both land whole in buckets -> the first such bucket.

    Those are quantized straight into the bucket memory (no temporary, no copy); a recipe with
    a split output goes through a temporary and the bucket copies. With cycled buffers (a
    copying transport) both outputs must share a bucket: the next bucket's buffer may still be
    on its way out as the previous bucket's payload.
    """
    first: dict[int, int] = {}
    excluded: set[int] = set()
    for index, (_, placed, _) in enumerate(closed):
        for c in placed:
            if id(c.part) in stand_ins:
                recipe = stand_ins[id(c.part)][0]
                first.setdefault(recipe, index)
                if not _is_whole(c) or (not adopts and first[recipe] != index):
                    excluded.add(recipe)
    return {recipe: index for recipe, index in first.items() if recipe not in excluded}


def _plan_bucket(
    index: int,
    entries: list[BucketEntry],
    placed: list[Placed],
    nbytes: int,
    stand_ins: Mapping[int, tuple[int, int]],
    direct: Mapping[int, int],
) -> _PlannedBucket:
    groups: list[_Group] = []
    sources: list[Tensor] = []
    chunks: list[tuple[int, Tensor, int, int]] = []
    derived: list[tuple[int, int, int, int, int | None]] = []
    for dtype in dict.fromkeys(c.dtype for c in placed):
        mine = sorted((c for c in placed if c.dtype == dtype), key=lambda c: c.offset)
        copy_spans: list[tuple[int, int, tuple[int, ...] | torch.Size]] = []
        into: list[tuple[int, int] | None] = []  # per span: (recipe, output) if written directly
        for c in mine:
            count, whole = c.nbytes // dtype.itemsize, _is_whole(c)
            # a whole part keeps its shape, so the Parameter itself is the copy source
            copy_spans.append((c.offset, c.nbytes, c.part.shape if whole else (count,)))
            key = stand_ins.get(id(c.part))  # fp8 codes or scales: recomputed on every replay
            into.append(key if key is not None and key[0] in direct else None)
            if into[-1] is not None:
                continue
            if key is not None:
                derived.append((len(sources), *key, c.start, None if whole else count))
            elif not whole:  # a chunk of a split tensor: flat
                chunks.append((len(sources), c.part, c.start, count))
            sources.append(c.part)
        served = [
            i
            for i, e in enumerate(entries)
            if e.dtype == dtype and e.nbytes == e.total_nbytes > 0 and not e.chunk_offset
        ]
        served_spans = [(entries[i].offset, entries[i].nbytes, entries[i].shape) for i in served]
        ct, where = _templates(copy_spans, dtype.itemsize)
        cw = [w for w, key in zip(where, into, strict=True) if key is None]
        to_bank = [(*key, w) for w, key in zip(where, into, strict=True) if key is not None]
        st, sw = _templates(served_spans, dtype.itemsize)
        groups.append(_Group(dtype, ct, cw, st, sw, served, to_bank))
    quantize_now = [recipe for recipe, first in direct.items() if first == index]
    return _PlannedBucket(
        entries, nbytes, _align(nbytes), groups, sources, chunks, derived, [], quantize_now
    )


def _structure(model: torch.nn.Module, modules: list[torch.nn.Module]) -> list[Any]:
    """Every submodule, parameter and buffer object of the model, in registration order."""
    return [
        v
        for m in (model, *modules)
        for d in (m._modules, m._parameters, m._buffers)
        for v in d.values()
    ]


class RefitPlan:
    """The recorded bucket layout of one model for one manifest, bucket size and transport."""

    def __init__(
        self,
        model: torch.nn.Module,
        packer: BucketPacker,
        manifest: Mapping[str, Any],
        quantized: QuantizedSources,
        *,
        adopts: bool,
    ) -> None:
        assert packer.closed is not None, "plan needs a recording packer"
        self.cfg = getattr(model, "cfg", None)
        self.bucket_bytes, self.device, self.adopts = packer.bucket_bytes, packer.device, adopts
        self.manifest = dict(manifest)
        self._modules = list(model.modules())[1:]  # not the model: the cache must not keep it
        self._objects = _structure(model, self._modules)  # held, so their ids stay unique
        self._ids = [id(v) for v in self._objects]
        direct = _direct_recipes(packer.closed, quantized.stand_ins, adopts=adopts)
        self.buckets = [_plan_bucket(i, *closed, quantized.stand_ins, direct)
                        for i, closed in enumerate(packer.closed)]  # fmt: skip
        self.recipes = quantized.parts  # per fp8 weight, the trainer parts it is quantized from
        last_use = {recipe: i for i, b in enumerate(self.buckets) for _, recipe, *_ in b.derived}
        for recipe, i in last_use.items():
            self.buckets[i].release.append(recipe)
        read = [p for b in self.buckets for p in b.sources if id(p) not in quantized.stand_ins]
        read += [p for parts in self.recipes for p in parts]
        self._params = list({id(p): p for p in read}.values())
        self._shapes = [p.shape for p in self._params]
        self.banks = Banks(self.buckets, device=self.device, adopts=adopts)

    def matches(
        self,
        model: torch.nn.Module,
        manifest: Mapping[str, Any],
        *,
        bucket_bytes: int,
        device: torch.device,
        adopts: bool,
    ) -> bool:
        """True if replaying gives exactly the buckets a planless refit would give now."""
        return (
            getattr(model, "cfg", None) is self.cfg
            and bucket_bytes == self.bucket_bytes
            and device == self.device
            and adopts == self.adopts
            and [id(v) for v in _structure(model, self._modules)] == self._ids
            and [p.shape for p in self._params] == self._shapes
            and manifest == self.manifest
        )

    def buckets_now(self) -> Iterator[Bucket]:
        """The buckets with the sources' current values (copies issued, not synced)."""
        bank = self.banks.take()
        outputs: dict[int, tuple[Tensor, Tensor]] = {}  # fp8 codes and scales, while carried
        for index, planned in enumerate(self.buckets):
            for recipe in planned.quantize_now:  # codes and scales straight into the bank
                out = (bank.fp8[recipe, 0], bank.fp8[recipe, 1])
                quantize_parts(self.recipes[recipe], self.device, out=out)
            sources = planned.sources
            if planned.chunks or planned.derived:
                sources = list(sources)
            for at, part, start, count in planned.chunks:  # slices taken now: `.data` may move
                sources[at] = part.reshape(-1)[start : start + count]
            for at, recipe, output, start, num in planned.derived:
                if recipe not in outputs:
                    outputs[recipe] = quantize_parts(self.recipes[recipe], self.device)
                made = outputs[recipe][output]
                sources[at] = made if num is None else made.reshape(-1)[start : start + num]
            if sources:
                torch._foreach_copy_(bank.dst[index], sources, non_blocking=True)
            for recipe in planned.release:  # freed after its copies were queued: stream-ordered
                del outputs[recipe]
            yield Bucket(index, bank.buffers[index], planned.entries, self.adopts,
                         bank.views[index])  # fmt: skip


def cached_plan(
    model: torch.nn.Module,
    manifest: Mapping[str, Any],
    *,
    bucket_bytes: int,
    device: torch.device,
    adopts: bool,
) -> RefitPlan | None:
    """The model's plan if it still matches everything it depends on, else None."""
    plan = _PLANS.get(model)
    if plan is None:
        return None
    if plan.matches(model, manifest, bucket_bytes=bucket_bytes, device=device, adopts=adopts):
        return plan
    del _PLANS[model]  # stale: release its references before a new one is recorded
    return None


def store_plan(model: torch.nn.Module, plan: RefitPlan) -> None:
    assert isinstance(plan.cfg, ModelConfig)
    _PLANS[model] = plan


def current_plan(model: torch.nn.Module) -> RefitPlan | None:
    """The plan recorded for `model` (checked only when a refit replays it)."""
    return _PLANS.get(model)
