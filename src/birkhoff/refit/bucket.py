"""Buckets: named tensors packed into flat uint8 buffers of at most `bucket_bytes`.

A bucket is one contiguous byte buffer plus a list of `BucketEntry` metadata rows (name, dtype,
shape, byte offset in the buffer, and the byte range of the tensor it carries). A tensor larger
than the room left in a bucket is split at element boundaries across as many buckets as needed;
every chunk names its byte range in the tensor, so the receiver reassembles it in any order and
can tell a missing, a repeated or an overlapping chunk apart (`Assembler`).

Design choices:
- The sender hands the packer an engine tensor as a list of *parts* whose dim-0 concatenation is
  the tensor (q/k/v, gate/up). Contiguous parts concatenated along dim 0 are their bytes
  concatenated, so fused tensors are packed without materialising `torch.cat`.
- The dtype cast to the engine dtype happens inside the copy into the bucket (`copy_` of a typed
  view), so a cast costs no extra pass over memory. Entries start at 16-byte aligned offsets so the
  typed views are legal and vectorised copies stay aligned.
- With `num_buffers` set, the packer cycles through that many preallocated buffers: a bucket stays
  valid until `num_buffers` further buckets were yielded. On one CUDA stream the consumer's copy
  out of a bucket is ordered before the packer's next write into it, so 2 buffers need no host
  sync. Without it, every bucket gets its own buffer (safe to keep, e.g. in tests).
- Metadata is plain picklable tuples, so a transport can send it with `broadcast_object_list`.
Left out: compression, checksums (the session checks names, shapes, dtypes, coverage and,
optionally, finiteness), multi-stream pipelining.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
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
    index: int
    buffer: Tensor  # uint8 [nbytes], possibly a view of a reused, larger buffer
    entries: list[BucketEntry] = field(default_factory=list)
    # the sender will never write this buffer again: a receiver may keep views into it
    transferable: bool = False
    # optional, in-process only: per entry, its whole tensor as a typed, shaped view of `buffer`
    # (None for a chunk), made by a sender that had them anyway, so the receiver need not
    views: list[Tensor | None] | None = None

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())


def as_bytes(t: Tensor) -> Tensor:
    """Flat uint8 view of a contiguous tensor's bytes (no copy)."""
    assert t.is_contiguous(), "byte view needs a contiguous tensor"
    return t.reshape(-1).view(torch.uint8)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def typed_views(buffer: Tensor, spans: Sequence[tuple[int, int, torch.dtype]]) -> list[Tensor]:
    """Flat views `buffer[offset:offset+nbytes].view(dtype)` for ascending, disjoint spans.

    When every span has one dtype, one `split` of the typed buffer makes all views (this runs
    per tensor per refit, so it avoids two Python-level tensor ops per span).
    """
    dtypes = {dtype for _, _, dtype in spans}
    itemsize = next(iter(dtypes)).itemsize if len(dtypes) == 1 else 0
    if not itemsize or buffer.numel() % itemsize or any(o % itemsize for o, _, _ in spans):
        return [buffer[o : o + n].view(dt) for o, n, dt in spans]
    sizes, pos = [], 0  # in elements: a gap before each span, then the span
    for offset, nbytes, _ in spans:
        sizes += [(offset - pos) // itemsize, nbytes // itemsize]
        pos = offset + nbytes
    sizes.append((buffer.numel() - pos) // itemsize)
    return list(buffer.view(next(iter(dtypes))).split(sizes)[1::2])


class Placed(NamedTuple):
    """Where one part (or a run of its elements) lands in a bucket; what a plan records."""

    offset: int  # byte offset in the bucket
    nbytes: int
    dtype: torch.dtype
    part: Tensor  # the part as handed to `add` (or the stand-in given as `record_as`)
    start: int  # element offset of the run in the flattened part


class BucketPacker:
    """Streams (name, parts, dtype) into buckets; `add` and `flush` yield full buckets.

    Placement: a tensor that fits in a bucket is never split (the bucket is closed first when the
    room left is too small); a tensor larger than a bucket gets buckets of its own. So every
    bucket holds whole tensors or chunks of a single oversized one, and a receiver may keep
    whole tensors as views of a transferable bucket (no copy out).
    Copies are planned as tensors arrive and issued when a bucket closes, all at once with
    `torch._foreach_copy_` (one call per bucket instead of one Python-level copy per tensor).
    """

    def __init__(
        self,
        bucket_bytes: int,
        *,
        device: torch.device | str,
        num_buffers: int | None = None,
        record: bool = False,
    ) -> None:
        if not isinstance(bucket_bytes, int) or bucket_bytes < MIN_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes={bucket_bytes!r} is invalid: must be an int >= 16")
        if num_buffers is not None and num_buffers < 1:
            raise ValueError(f"num_buffers={num_buffers!r} is invalid: must be >= 1 or None")
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device)
        self.num_buffers = num_buffers
        self._pool: list[Tensor] = []
        self._index = 0
        self._pos = 0  # aligned offset where the next tensor starts
        self._entries: list[BucketEntry] = []
        self._placed: list[Placed] = []  # the pending copies of the open bucket ...
        self._srcs: list[Tensor] = []  # ... and their flat sources (any dtype, any device)
        # with record=True: (entries, placements, bytes used) of every closed bucket, for a plan
        self.closed: list[tuple[list[BucketEntry], list[Placed], int]] | None = (
            [] if record else None
        )

    def _buffer(self, nbytes: int) -> Tensor:
        """Exactly `nbytes` fresh (transferable) or a slice of a cycled pool buffer."""
        if self.num_buffers is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        slot = self._index % self.num_buffers
        if slot == len(self._pool):
            self._pool.append(torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device))
        return self._pool[slot][:nbytes]

    def _close(self) -> Bucket:
        used = max((c.offset + c.nbytes for c in self._placed), default=0)
        buffer = self._buffer(used)
        if self._placed:
            spans = [(c.offset, c.nbytes, c.dtype) for c in self._placed]
            dst = typed_views(buffer, spans)
            torch._foreach_copy_(dst, self._srcs, non_blocking=True)
        bucket = Bucket(self._index, buffer, self._entries, self.num_buffers is None)
        if self.closed is not None:
            self.closed.append((self._entries, self._placed, used))
        self._index += 1
        self._pos, self._entries, self._placed, self._srcs = 0, [], [], []
        return bucket

    def add(
        self,
        name: str,
        parts: Sequence[Tensor],
        dtype: torch.dtype,
        *,
        record_as: Sequence[Tensor] | None = None,
    ) -> Iterator[Bucket]:
        """Pack the dim-0 concatenation of `parts`, cast to `dtype`; yield buckets that fill up.

        `record_as`: per part, the tensor a recording packer notes in its place (e.g. a meta
        stand-in for a temporary that a plan recomputes), so the record never keeps it alive.
        """
        assert parts, f"{name}: no parts"
        assert record_as is None or len(record_as) == len(parts), f"{name}: record_as length"
        recorded = parts if record_as is None else record_as
        itemsize = dtype.itemsize
        if len(parts) == 1:
            shape, total = tuple(parts[0].shape), parts[0].numel() * itemsize
        else:
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            total = sum(p.numel() for p in parts) * itemsize
        if 0 < total <= self.bucket_bytes - self._pos:  # common case: one piece, no split
            offset = self._pos
            self._entries.append(BucketEntry(name, dtype, shape, offset, total, 0, total))
            for part, noted in zip(parts, recorded, strict=True):
                nbytes = part.numel() * itemsize
                self._placed.append(Placed(offset, nbytes, dtype, noted, 0))
                self._srcs.append(part.reshape(-1))
                offset += nbytes
            self._pos = min(_align(offset), self.bucket_bytes)
            return
        if total == 0:  # an empty tensor still announces itself (offset is meaningless)
            self._entries.append(BucketEntry(name, dtype, shape, 0, 0, 0, 0))
            return
        oversized = total > self.bucket_bytes
        if self._entries and (oversized or total > self.bucket_bytes - self._pos):
            yield self._close()
        offset, first = self._pos, 0  # where this bucket's piece starts: in bucket, in tensor
        done = 0  # bytes of this tensor planned so far; parts are contiguous within the tensor
        for part, noted in zip(parts, recorded, strict=True):
            flat, start = part.reshape(-1), 0
            while start < flat.numel():
                pos = offset + done - first
                count = min((self.bucket_bytes - pos) // itemsize, flat.numel() - start)
                if count == 0:  # bucket full: close it with this tensor's piece so far
                    self._entries.append(BucketEntry(name, dtype, shape, offset, done - first,
                                                     first, total))  # fmt: skip
                    yield self._close()
                    offset, first = 0, done
                    continue
                self._placed.append(Placed(pos, count * itemsize, dtype, noted, start))
                self._srcs.append(flat[start : start + count])
                start, done = start + count, done + count * itemsize
        self._entries.append(BucketEntry(name, dtype, shape, offset, done - first, first, total))
        self._pos = min(_align(offset + done - first), self.bucket_bytes)
        if oversized:  # its last chunk does not share a bucket with whole tensors
            yield self._close()

    def flush(self) -> Iterator[Bucket]:
        """Yield the last, partly filled bucket (if it holds anything)."""
        if self._entries:
            yield self._close()


def pack_buckets(
    named: Iterable[tuple[str, Tensor]], bucket_bytes: int, *, device: torch.device | str
) -> Iterator[Bucket]:
    """Pack (name, tensor) pairs as they are, each bucket in its own buffer."""
    packer = BucketPacker(bucket_bytes, device=device)
    for name, tensor in named:
        yield from packer.add(name, [tensor], tensor.dtype)
    yield from packer.flush()


class Assembler:
    """Reassembles chunks into whole tensors and records what went wrong, without raising.

    `duplicated` holds names with a chunk whose byte range overlaps one already received (those
    bytes are not written again); `inconsistent` names whose chunks disagree on dtype, shape or
    size.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.tensors: dict[str, Tensor] = {}
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        self.covered: dict[str, int] = {}
        self._ranges: dict[str, list[tuple[int, int]]] = {}
        self.duplicated: set[str] = set()
        self.inconsistent: set[str] = set()

    def add(self, entry: BucketEntry, chunk: Tensor) -> bool:
        """Store one chunk (flat bytes or elements); True when its tensor became complete."""
        name = entry.name
        chunk = chunk.view(torch.uint8) if chunk.dtype != torch.uint8 else chunk
        spec = (entry.dtype, tuple(entry.shape), entry.total_nbytes)
        if name not in self.tensors:
            self.tensors[name] = torch.empty(spec[1], dtype=spec[0], device=self.device)
            self.specs[name], self.covered[name], self._ranges[name] = spec, 0, []
            if self.tensors[name].numel() * spec[0].itemsize != spec[2]:
                self.inconsistent.add(name)
        elif self.specs[name] != spec:
            self.inconsistent.add(name)
            return False
        lo, hi = entry.chunk_offset, entry.chunk_offset + entry.nbytes
        if name in self.inconsistent or hi > spec[2] or not self._claim(name, lo, hi):
            return False
        if hi > lo:
            as_bytes(self.tensors[name])[lo:hi].copy_(chunk, non_blocking=True)
        self.covered[name] += hi - lo
        return self.covered[name] == spec[2]

    def adopt(self, entry: BucketEntry, chunk: Tensor) -> bool:
        """Keep a whole tensor as a view of `chunk` (of a transferable bucket), no copy.

        Anything that is not a first, whole, consistent arrival goes through `add` instead, so
        duplicates and mismatches are recorded exactly as for copied chunks.
        """
        whole = entry.chunk_offset == 0 and entry.nbytes == entry.total_nbytes > 0
        if not whole or entry.name in self.tensors or entry.offset % entry.dtype.itemsize:
            return self.add(entry, chunk)
        flat = chunk if chunk.dtype == entry.dtype else chunk.view(torch.uint8).view(entry.dtype)
        if flat.numel() != math.prod(entry.shape):
            return self.add(entry, chunk)
        name = entry.name
        self.tensors[name] = flat.view(entry.shape)
        self.specs[name] = (entry.dtype, tuple(entry.shape), entry.total_nbytes)
        self.covered[name], self._ranges[name] = entry.nbytes, [(0, entry.nbytes)]
        return True

    def adopt_views(self, bucket: Bucket) -> None:
        """`adopt` for a bucket that carries its views: each whole tensor is kept as its view.

        A view that does not match its entry exactly, a repeated name or a chunk goes through
        `add` (bookkeeping identical to `adopt`); this is `adopt` without a Python-level view op
        per tensor.
        """
        assert bucket.views is not None and len(bucket.views) == len(bucket.entries)
        tensors, specs, covered, ranges = self.tensors, self.specs, self.covered, self._ranges
        for entry, view in zip(bucket.entries, bucket.views, strict=True):
            name, nbytes = entry.name, entry.nbytes
            if (
                view is None
                or not nbytes
                or name in tensors
                or entry.chunk_offset
                or nbytes != entry.total_nbytes
                or view.dtype != entry.dtype
                or view.shape != entry.shape
            ):
                self.add(entry, bucket.buffer[entry.offset : entry.offset + nbytes])
                continue
            tensors[name] = view
            specs[name] = (entry.dtype, tuple(entry.shape), nbytes)
            covered[name], ranges[name] = nbytes, [(0, nbytes)]

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


def unpack_bucket(bucket: Bucket) -> Iterator[tuple[BucketEntry, Tensor]]:
    """(entry, uint8 view of its bytes) for every chunk in the bucket; zero-copy."""
    for entry in bucket.entries:
        yield entry, bucket.buffer[entry.offset : entry.offset + entry.nbytes]


def unpack_typed(bucket: Bucket) -> list[tuple[BucketEntry, Tensor]]:
    """(entry, flat view of its elements in entry.dtype) for every chunk; zero-copy."""
    spans = [(e.offset, e.nbytes, e.dtype) for e in bucket.entries]
    ordered = all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    if not ordered or any(n % dt.itemsize for _, n, dt in spans):  # malformed: bytes, as is
        return [(e, c) for e, c in unpack_bucket(bucket)]
    return list(zip(bucket.entries, typed_views(bucket.buffer, spans), strict=True))


def unpack_buckets(
    buckets: Iterable[Bucket], *, device: torch.device | str
) -> Iterator[tuple[str, Tensor]]:
    """Reassemble (name, tensor) pairs, each yielded as soon as its last chunk arrived."""
    assembler = Assembler(device)
    for bucket in buckets:
        for entry, chunk in unpack_bucket(bucket):
            if assembler.add(entry, chunk):
                yield entry.name, assembler.tensors[entry.name]
    problems = assembler.duplicated | assembler.inconsistent | assembler.incomplete()
    if problems:
        raise ValueError(f"buckets did not reassemble cleanly: {sorted(problems)}")
