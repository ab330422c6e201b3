"""Packing a model's weights into buckets in the engine's layout, cast or fp8-quantized.

`refit_layout(cfg, manifest, bucket_bytes)` is a pure, memoised function: where every served
tensor goes and each bucket's copy program. It refers to no model object, so it cannot go stale;
each refit looks the sources up by name (`RefitLayout.sources`, shapes checked). `Bank` holds
the buffers of one layout with every view the program writes, made once (who may reuse it is
the transport's business). A bf16 tensor is one fused-cast `copy_` per trainer part, a bucket's
copies one `torch._foreach_copy_`; an fp8 weight is quantized straight into the bucket; only
tensors larger than a bucket go through a temporary. Details: docs/refit.md.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.fp8 import FP8_DTYPE, SCALE_SUFFIX, quantize_parts
from birkhoff.engine.layout import SourceError, TensorSpec, engine_parts, trainer_tensors
from birkhoff.refit.bucket import Bucket, BucketEntry, as_bytes, bucket_nbytes, bucket_views, place
from birkhoff.refit.session import RefitError

Spec = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class PlannedBucket:
    entries: tuple[BucketEntry, ...]
    nbytes: int
    copy_entries: tuple[tuple[int, tuple[int, ...]], ...]  # (entry, rows of each part)
    copies: tuple[int, ...]  # index in `RefitLayout.parts` of each copy source, in copy order
    quantize: tuple[tuple[int, int, str], ...]  # (codes entry, scales entry, weight name)
    from_temporary: tuple[tuple[int, str, int], ...]  # (entry, engine name, output 0 | 1)
    release: tuple[str, ...]  # temporaries no later bucket reads


@dataclass(frozen=True, slots=True)
class RefitLayout:
    parts: tuple[str, ...]  # trainer names of every source, grouped by engine tensor
    shapes: tuple[tuple[int, ...], ...]
    spans: dict[str, tuple[int, int]]  # engine name -> its parts' range in `parts`
    dtypes: dict[str, torch.dtype]  # engine name -> served dtype
    buckets: tuple[PlannedBucket, ...]
    problems: tuple[tuple[str, ...], tuple[tuple[str, str], ...]]  # (missing, mismatched)

    def sources(self, model: torch.nn.Module) -> list[Tensor]:
        """The model's current Parameters in `parts` order; RefitError naming any problem."""
        missing, mismatched = list(self.problems[0]), dict(self.problems[1])
        if not missing and not mismatched:
            try:
                return trainer_tensors(model, self.parts, self.shapes)
            except SourceError as err:
                missing, mismatched = err.missing, err.mismatched
        raise RefitError(missing=missing, mismatched=mismatched)


def manifest_key(manifest: Mapping[str, TensorSpec]) -> tuple[Spec, ...]:
    return tuple((name, spec.dtype, tuple(spec.shape)) for name, spec in manifest.items())


def _groups(specs: tuple[Spec, ...]) -> list[list[Spec]]:
    """One group per served tensor, an fp8 weight's scales in the group of its codes."""
    groups: list[list[Spec]] = []
    for spec in specs:
        base = spec[0].removesuffix(SCALE_SUFFIX)
        if spec[0] != base and groups and groups[-1][0][0] == base:
            groups[-1].append(spec)
        else:
            groups.append([spec])
    return groups


@functools.lru_cache(maxsize=16)
def refit_layout(cfg: ModelConfig, specs: tuple[Spec, ...], bucket_bytes: int) -> RefitLayout:
    """Where every served tensor goes and how each bucket is written (pure, memoised)."""
    table = engine_parts(cfg)
    served = {name: dtype for name, dtype, _ in specs}
    parts: list[tuple[str, tuple[int, ...]]] = []
    spans: dict[str, tuple[int, int]] = {}
    missing, mismatched = [], {}
    for name, _, shape in specs:
        if name.endswith(SCALE_SUFFIX) and served.get(name.removesuffix(SCALE_SUFFIX)) == FP8_DTYPE:
            continue
        if name not in table:
            missing.append(name)
            continue
        want = (sum(s[0] for _, s in table[name]), *table[name][0][1][1:])
        if want != shape:
            mismatched[name] = f"the model's layout has shape {list(want)}, engine {list(shape)}"
        spans[name] = (len(parts), len(parts) + len(table[name]))
        parts += table[name]
    placed = place(_groups(specs), bucket_bytes)
    buckets = _plan_buckets(placed, spans, parts, served)
    return RefitLayout(
        tuple(n for n, _ in parts),
        tuple(s for _, s in parts),
        spans,
        served,
        buckets,
        (tuple(missing), tuple(mismatched.items())),
    )


def _plan_buckets(
    placed: list[list[BucketEntry]],
    spans: dict[str, tuple[int, int]],
    parts: list[tuple[str, tuple[int, ...]]],
    served: dict[str, torch.dtype],
) -> tuple[PlannedBucket, ...]:
    last_read: dict[str, int] = {}
    plans = []
    for index, entries in enumerate(placed):
        whole = {
            e.name: i
            for i, e in enumerate(entries)
            if e.chunk_offset == 0 and e.nbytes == e.total_nbytes > 0
        }
        copy_entries: list[tuple[int, tuple[int, ...]]] = []
        copies: list[int] = []
        quantize: list[tuple[int, int, str]] = []
        temporary: list[tuple[int, str, int]] = []
        for i, e in enumerate(entries):
            base = e.name.removesuffix(SCALE_SUFFIX)
            output = 1 if base != e.name and served.get(base) == FP8_DTYPE else 0
            if output == 0:
                base = e.name
            if base not in spans:
                continue  # an engine name the model's layout lacks: reported, never packed
            lo, hi = spans[base]
            scales = base + SCALE_SUFFIX
            fp8 = served[base] == FP8_DTYPE
            if not fp8 and e.name in whole:
                copy_entries.append((i, tuple(s[0] for _, s in parts[lo:hi])))
                copies += range(lo, hi)
            elif fp8 and base in whole and scales in whole:
                if output == 0:
                    quantize.append((whole[base], whole[scales], base))
            else:
                temporary.append((i, base, output))
                last_read[base] = index
        plans.append((entries, copy_entries, copies, quantize, temporary))
    return tuple(
        PlannedBucket(
            tuple(entries),
            bucket_nbytes(entries),
            tuple(ce),
            tuple(c),
            tuple(q),
            tuple(t),
            tuple(b for b, last in last_read.items() if last == index),
        )
        for index, (entries, ce, c, q, t) in enumerate(plans)
    )


class Bank:
    """One buffer per bucket of a layout, with its views: the served ones and the copy targets.

    `buffers` may be fresh memory per bucket or slices of a few reused buffers (the transport
    decides, and decides when a bank may be written again).
    """

    def __init__(self, layout: RefitLayout, buffers: list[Tensor]) -> None:
        self.layout = layout
        self.buffers = [buf[: b.nbytes] for b, buf in zip(layout.buckets, buffers, strict=True)]
        self.views = [
            bucket_views(buf, b.entries)
            for b, buf in zip(layout.buckets, self.buffers, strict=True)
        ]
        self.dsts: list[list[Tensor]] = []
        for b, views in zip(layout.buckets, self.views, strict=True):
            dsts: list[Tensor] = []
            for i, rows in b.copy_entries:
                view = views[i]
                assert view is not None
                dsts += view.split(rows) if len(rows) > 1 else [view]
            self.dsts.append(dsts)


def fill(bank: Bank, sources: Sequence[Tensor], *, device: torch.device) -> Iterator[Bucket]:
    """Write every bucket of `bank` from `sources` (in layout order) and yield it once written."""
    layout = bank.layout
    temporaries: dict[str, tuple[Tensor, ...]] = {}
    for index, planned in enumerate(layout.buckets):
        views, buffer = bank.views[index], bank.buffers[index]
        for codes, scales, name in planned.quantize:
            lo, hi = layout.spans[name]
            quantize_parts(list(sources[lo:hi]), device, out=(views[codes], views[scales]))  # type: ignore[arg-type]
        dsts, srcs = bank.dsts[index], [sources[j] for j in planned.copies]
        if planned.from_temporary:
            dsts = list(dsts)
            for i, name, output in planned.from_temporary:
                if name not in temporaries:
                    temporaries[name] = _whole(layout, sources, name, device)
                e = planned.entries[i]
                dsts.append(buffer[e.offset : e.offset + e.nbytes])
                src = as_bytes(temporaries[name][output])
                srcs.append(src[e.chunk_offset : e.chunk_offset + e.nbytes])
        if dsts:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        for name in planned.release:  # after its copies were queued: stream-ordered on CUDA
            del temporaries[name]
        yield Bucket(index, buffer, planned.entries, views)


def _whole(
    layout: RefitLayout, sources: Sequence[Tensor], name: str, device: torch.device
) -> tuple[Tensor, ...]:
    """An engine tensor made whole: fp8 (codes, scales), else the cast concatenation."""
    lo, hi = layout.spans[name]
    parts = list(sources[lo:hi])
    if layout.dtypes[name] == FP8_DTYPE:
        return quantize_parts(parts, device)
    cat = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return (cat.to(device=device, dtype=layout.dtypes[name]).contiguous(),)
