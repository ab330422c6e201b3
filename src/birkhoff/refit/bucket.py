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

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())


def as_bytes(t: Tensor) -> Tensor:
    """Flat uint8 view of a contiguous tensor's bytes (no copy)."""
    assert t.is_contiguous(), "byte view needs a contiguous tensor"
    return t.reshape(-1).view(torch.uint8)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class BucketPacker:
    """Streams (name, parts, dtype) into buckets; `add` and `flush` yield full buckets."""

    def __init__(
        self, bucket_bytes: int, *, device: torch.device | str, num_buffers: int | None = None
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
        self._pos = 0  # next aligned write offset
        self._used = 0  # end of the last chunk written
        self._entries: list[BucketEntry] = []
        self._buffer = self._next_buffer()

    def _next_buffer(self) -> Tensor:
        if self.num_buffers is None:
            return torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        slot = self._index % self.num_buffers
        if slot == len(self._pool):
            self._pool.append(torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device))
        return self._pool[slot]

    def _close(self) -> Bucket:
        bucket = Bucket(self._index, self._buffer[: self._used], self._entries)
        self._index += 1
        self._pos, self._used, self._entries = 0, 0, []
        self._buffer = self._next_buffer()
        return bucket

    def add(self, name: str, parts: Sequence[Tensor], dtype: torch.dtype) -> Iterator[Bucket]:
        """Pack the dim-0 concatenation of `parts`, cast to `dtype`; yield buckets that fill up."""
        assert parts, f"{name}: no parts"
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:]) if parts[0].dim() else ()
        itemsize = dtype.itemsize
        total = sum(p.numel() for p in parts) * itemsize
        done = 0  # bytes of this tensor already packed
        for part in parts:
            flat = part.reshape(-1)
            start = 0  # elements of this part already packed
            while start < flat.numel():
                room = (self.bucket_bytes - self._pos) // itemsize
                if room == 0:
                    yield self._close()
                    continue
                count = min(room, flat.numel() - start)
                nbytes = count * itemsize
                dst = self._buffer[self._pos : self._pos + nbytes].view(dtype)
                dst.copy_(flat[start : start + count], non_blocking=True)
                self._entries.append(
                    BucketEntry(name, dtype, shape, self._pos, nbytes, done, total)
                )
                self._used = self._pos + nbytes
                self._pos = min(_align(self._used), self.bucket_bytes)
                start += count
                done += nbytes
        if total == 0:  # an empty tensor still announces itself (offset is meaningless)
            self._entries.append(BucketEntry(name, dtype, shape, 0, 0, 0, 0))

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
        """Store one chunk (uint8 [entry.nbytes]); True when its tensor became complete."""
        name = entry.name
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
