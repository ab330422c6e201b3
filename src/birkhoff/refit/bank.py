"""Banks: reusable bucket buffers with every view a refit replay needs, made once.

A bank is one buffer per planned bucket, the copy-destination views of each bucket in its
sources' order, the fp8 code/scale views a replay quantizes straight into, and (for a transport
that adopts buckets) the served views the engine will keep as its weights. Making these views
costs a few microseconds each per refit, most of a replay's host time before banks existed.

Ownership: in process, the engine serves a bank's views, so `Banks` keeps two and hands out one
only while nothing outside it holds it: no extra reference to any of its served tensor objects
(the engine's current dict, or a dict or tensor someone kept) and no other tensor on its
buffers' memory (a view or slice someone made; torch's storage use count, which cudagraph
trees read for the same purpose). If the bank due for reuse is held, a fresh one is made and
the held one forgotten (its holders keep it alive), so a refit never writes memory that the
engine, a generation in flight or a caller still reads. In steady state (the engine serves bank
A, nobody keeps the previous version) refit n+1 writes bank B and refit n+2 bank A again: no
allocation and no Python-level view op per tensor. Reuse relies on one stream: the copies of a
refit are queued after the kernels that last read the bank. For a transport that copies the
payload (broadcast) there is one bank whose buckets cycle through two buffers, like
`BucketPacker`. Memory: two copies of the served weights stay allocated.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from birkhoff.refit.plan import _PlannedBucket


def storage_users(t: Tensor) -> int:
    """How many tensors share `t`'s memory (torch's own count; cudagraph trees read it too)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class Bank:
    """One buffer per bucket with every view the replays need, made once and reused.

    `dst[i]` are the copy destinations of bucket i in its sources' order, `views[i]` its served
    views (one per entry, None for a chunk) when the transport adopts buckets.
    """

    def __init__(self, buckets: list[_PlannedBucket], buffers: list[Tensor], served: bool) -> None:
        unflatten = torch._C._nn.unflatten_dense_tensors
        self.buffers = [
            buffer[: planned.nbytes] for planned, buffer in zip(buckets, buffers, strict=True)
        ]
        self.dst: list[list[Tensor]] = []
        self.views: list[list[Tensor | None] | None] = []
        self.fp8: dict[tuple[int, int], Tensor] = {}  # (recipe, 0 codes | 1 scales) -> view
        for planned, buffer in zip(buckets, buffers, strict=True):
            dst: list[Tensor] = []
            views: list[Tensor | None] = [None] * len(planned.entries)
            for g in planned.groups:
                typed = buffer.view(g.dtype)
                made = unflatten(typed, g.copy_templates)
                dst += [made[i] for i in g.copy_where]
                for recipe, output, i in g.direct:
                    self.fp8[recipe, output] = made[i]
                if served:
                    made = unflatten(typed, g.served_templates)
                    for entry, i in zip(g.served_entries, g.served_where, strict=True):
                        views[entry] = made[i]
            self.dst.append(dst)
            self.views.append(views if served else None)
        self._baseline: list[int] = []

    def _references(self) -> list[int]:
        # the same expression at baseline and at every check: only outside holders differ
        served = [sys.getrefcount(v) for vs in self.views if vs for v in vs if v is not None]
        return served + [storage_users(b) for b in self.buffers]

    def seal(self) -> Bank:
        """Record the references the bank itself holds (call once it is built)."""
        self._baseline = self._references()
        return self

    def held(self) -> bool:
        """True if anything outside the bank references a served tensor or the memory."""
        return self._references() != self._baseline


class Banks:
    """At most two banks for one plan, least recently used first."""

    def __init__(
        self, buckets: list[_PlannedBucket], *, device: torch.device, adopts: bool
    ) -> None:
        self.buckets, self.device, self.adopts = buckets, device, adopts
        self._banks: list[Bank] = []
        self.made = 0  # banks allocated so far (2 in steady state)

    def _new(self) -> Bank:
        self.made += 1
        if self.adopts:  # one fresh buffer per bucket: the engine will serve views of it
            buffers = [torch.empty(b.alloc, dtype=torch.uint8, device=self.device)
                       for b in self.buckets]  # fmt: skip
        else:  # two buffers cycled: the transport copies a bucket out before the next reuse
            size = max((b.alloc for b in self.buckets), default=0)
            pool = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in "ab"]
            buffers = [pool[i % 2][: b.alloc] for i, b in enumerate(self.buckets)]
        return Bank(self.buckets, buffers, served=self.adopts).seal()

    def take(self) -> Bank:
        """The least recently used bank that nothing outside holds, else a new one."""
        if not self.adopts:
            if not self._banks:
                self._banks.append(self._new())
            return self._banks[0]
        free = next((b for b in self._banks if not b.held()), None)
        if free is None:
            free = self._new()
            if len(self._banks) == 2:  # forget the older held one; its holders keep it alive
                self._banks.pop(0)
        else:
            self._banks.remove(free)
        self._banks.append(free)  # most recently used last
        return free
