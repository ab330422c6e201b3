"""Buckets: named tensors in flat uint8 buffers of at most `bucket_bytes`, and their reassembly.

A bucket is one contiguous byte buffer plus `BucketEntry` rows (name, dtype, shape, byte offset
in the buffer, and the byte range of the tensor it carries). `place` decides where every tensor
goes, from names, dtypes and shapes alone: a group of tensors (an fp8 weight and its scales)
that fits in the room left stays whole in one bucket, else it starts a new bucket; a group
larger than a bucket is split at element boundaries across buckets of its own. Every chunk
names its byte range in the tensor, so the receiver reassembles it in any order and can tell a
missing, a repeated or an overlapping chunk apart (`Assembler`). Entries start at 16-byte
aligned offsets, so typed views of the buffer are legal and vectorised copies stay aligned.
Metadata is plain picklable tuples, so a transport can send it with `broadcast_object_list`.
Left out: compression, checksums (the session checks names, shapes, dtypes, coverage and,
optionally, finiteness).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

ALIGN = 16  # bytes; >= the largest itemsize we pack, keeps typed views legal
MIN_BUCKET_BYTES = ALIGN


class BucketEntry(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of this chunk in the bucket buffer
    nbytes: int  # bytes of this chunk
    chunk_offset: int  # byte offset of this chunk inside the whole tensor
    total_nbytes: int  # bytes of the whole tensor


@dataclass(slots=True)
class Bucket:
    """One bucket; once sent, its buffer belongs to the receiver (the sender never writes it
    again while the receiver may serve it; see the transports)."""

    index: int
    buffer: Tensor  # uint8 [nbytes]
    entries: Sequence[BucketEntry]
    # per entry, its whole tensor as a typed, shaped view of `buffer` (None for a chunk); the
    # sender passes the views it wrote through, so the receiver need not make them again
    views: Sequence[Tensor | None] | None = None

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())


Spec = tuple[str, torch.dtype, tuple[int, ...]]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(spec: Spec) -> int:
    return math.prod(spec[2]) * spec[1].itemsize


def place(groups: Sequence[Sequence[Spec]], bucket_bytes: int) -> list[list[BucketEntry]]:
    """The entries of every bucket for `groups` of (name, dtype, shape), in order."""
    buckets: list[list[BucketEntry]] = []
    entries: list[BucketEntry] = []
    pos = 0

    def whole_at(start: int, group: Sequence[Spec]) -> list[BucketEntry] | None:
        out, at = [], start
        for spec in group:
            at, n = _align(at), _nbytes(spec)
            out.append(BucketEntry(*spec, at, n, 0, n))
            at += n
        return out if at <= bucket_bytes else None

    for group in groups:
        placed = whole_at(pos, group)
        if placed is None and entries:
            buckets.append(entries)
            entries, pos = [], 0
            placed = whole_at(0, group)
        if placed is not None:
            entries += placed
            pos = max(pos, *(e.offset + e.nbytes for e in placed))
            continue
        for name, dtype, shape in group:  # larger than a bucket: chunks in buckets of its own
            total, done = _nbytes((name, dtype, shape)), 0
            while done < total or not total:
                pos = _align(pos)
                room = max(bucket_bytes - pos, 0) // dtype.itemsize * dtype.itemsize
                if not room:
                    buckets.append(entries)
                    entries, pos = [], 0
                    continue
                n = min(room, total - done)
                entries.append(BucketEntry(name, dtype, shape, pos, n, done, total))
                pos, done = pos + n, done + n
                if not total:
                    break
        buckets.append(entries)
        entries, pos = [], 0
    if entries:
        buckets.append(entries)
    return buckets


def bucket_nbytes(entries: Sequence[BucketEntry]) -> int:
    return max((e.offset + e.nbytes for e in entries), default=0)


def as_bytes(t: Tensor) -> Tensor:
    """Flat uint8 view of a contiguous tensor's bytes (no copy)."""
    assert t.is_contiguous(), "byte view needs a contiguous tensor"
    return t.reshape(-1).view(torch.uint8)


def entry_view(buffer: Tensor, e: BucketEntry) -> Tensor | None:
    """The whole tensor an entry carries as a typed, shaped view of `buffer`; None for a chunk
    or an entry whose fields disagree (which reassembly then records)."""
    itemsize = e.dtype.itemsize
    whole = e.chunk_offset == 0 and e.nbytes == e.total_nbytes > 0
    if not whole or e.offset % itemsize or e.nbytes != math.prod(e.shape) * itemsize:
        return None
    if e.offset + e.nbytes > buffer.numel():
        return None
    return buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)


def bucket_views(buffer: Tensor, entries: Sequence[BucketEntry]) -> list[Tensor | None]:
    return [entry_view(buffer, e) for e in entries]


class Assembler:
    """Stages a bucket's tensors and records what went wrong, without raising.

    Whole tensors are kept as views of their bucket's buffer (no copy); chunks are copied into a
    staging tensor per name. `duplicated` holds names with bytes that overlap bytes already
    received (those are not written again); `inconsistent` names whose chunks disagree on
    dtype, shape or size.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.tensors: dict[str, Tensor] = {}
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        self.covered: dict[str, int] = {}
        self._ranges: dict[str, list[tuple[int, int]]] = {}
        self.duplicated: set[str] = set()
        self.inconsistent: set[str] = set()

    def stage(self, bucket: Bucket) -> None:
        """Keep each whole tensor of `bucket` as its view; copy every chunk."""
        views = (
            bucket.views
            if bucket.views is not None
            else bucket_views(bucket.buffer, bucket.entries)
        )
        tensors, specs, covered, ranges = self.tensors, self.specs, self.covered, self._ranges
        for entry, view in zip(bucket.entries, views, strict=True):
            name = entry.name
            if view is None or name in tensors:
                self.add(entry, bucket.buffer[entry.offset : entry.offset + entry.nbytes])
                continue
            tensors[name] = view
            specs[name] = (entry.dtype, tuple(entry.shape), entry.nbytes)
            covered[name], ranges[name] = entry.nbytes, [(0, entry.nbytes)]

    def add(self, entry: BucketEntry, chunk: Tensor) -> None:
        """Copy one chunk (flat bytes) into its staging tensor."""
        name = entry.name
        spec = (entry.dtype, tuple(entry.shape), entry.total_nbytes)
        if name not in self.tensors:
            self.tensors[name] = torch.empty(spec[1], dtype=spec[0], device=self.device)
            self.specs[name], self.covered[name], self._ranges[name] = spec, 0, []
            if self.tensors[name].numel() * spec[0].itemsize != spec[2]:
                self.inconsistent.add(name)
        elif self.specs[name] != spec:
            self.inconsistent.add(name)
            return
        lo, hi = entry.chunk_offset, entry.chunk_offset + entry.nbytes
        if name in self.inconsistent or hi > spec[2] or not self._claim(name, lo, hi):
            return
        if hi > lo:
            as_bytes(self.tensors[name])[lo:hi].copy_(chunk, non_blocking=True)
        self.covered[name] += hi - lo

    def _claim(self, name: str, lo: int, hi: int) -> bool:
        """Record [lo, hi) as received; False (and mark duplicated) if it overlaps earlier data."""
        ranges = self._ranges[name]
        i = bisect.bisect_left(ranges, (lo, hi))
        overlaps_prev = i > 0 and ranges[i - 1][1] > lo
        overlaps_next = i < len(ranges) and ranges[i][0] < hi
        repeated_empty = hi == lo and i < len(ranges) and ranges[i] == (lo, hi)
        if overlaps_prev or overlaps_next or repeated_empty:
            self.duplicated.add(name)
            return False
        ranges.insert(i, (lo, hi))
        return True

    def incomplete(self) -> set[str]:
        return {n for n, (_, _, total) in self.specs.items() if self.covered[n] != total}

    def gaps(self, name: str) -> list[tuple[int, int]]:
        """Byte ranges [lo, hi) of `name` that no chunk covered."""
        out, at = [], 0
        for lo, hi in self._ranges[name]:
            if lo > at:
                out.append((at, lo))
            at = max(at, hi)
        total = self.specs[name][2]
        return out + [(at, total)] if at < total else out
