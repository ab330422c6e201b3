"""Refit sources from FSDP2 shards: each trainer tensor gathered when its bucket is written.

Under FSDP2 every rank holds a shard of each Parameter (a DTensor). The refit layout is the same
on every rank (a pure function of the config, the manifest and the bucket size), so `fill` reads
the sources in the same order everywhere; `GatheredSources` turns each read of a sharded source
into `DTensor.full_tensor()` (one all-gather over the shard group, which every rank runs in that
same order) and keeps the gathered tensors of the current bucket only. No rank ever holds more
of the full model than the tensors of one bucket (plus one tensor larger than a bucket, which
`fill` makes whole in a temporary either way). The buckets then go through the one refit path
(`birkhoff.refit.api.refit`): the engine's session, one completeness check, atomic commit.

Design choice: the gather happens where `fill` reads, not in a separate pass, so a colocated
refit from shards is the in-process refit with a collective in front of each read; without a
DTensor among the sources `gathered` returns the list unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

from torch import Tensor
from torch.distributed.tensor import DTensor


class GatheredSources(Sequence[Tensor]):
    """A list of trainer tensors whose DTensor entries are gathered on read, one bucket kept."""

    def __init__(self, sources: list[Tensor]) -> None:
        self._sources = sources
        self._kept: dict[int, Tensor] = {}
        self.gathered_bytes = 0  # bytes all-gathered so far
        self.max_kept_bytes = 0  # the most gathered bytes held at once (about one bucket)
        self._kept_bytes = 0

    def __len__(self) -> int:
        return len(self._sources)

    @overload
    def __getitem__(self, index: int) -> Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> list[Tensor]: ...
    def __getitem__(self, index: int | slice) -> Tensor | list[Tensor]:
        if isinstance(index, slice):
            return [self._read(i) for i in range(*index.indices(len(self)))]
        return self._read(index)

    def _read(self, index: int) -> Tensor:
        source = self._sources[index]
        if not isinstance(source, DTensor):
            return source
        if index not in self._kept:
            full = source.full_tensor()
            nbytes = full.numel() * full.element_size()
            self.gathered_bytes += nbytes
            self._kept_bytes += nbytes
            self.max_kept_bytes = max(self.max_kept_bytes, self._kept_bytes)
            self._kept[index] = full
        return self._kept[index]

    def release(self) -> None:
        """Drop the gathered tensors (after a bucket's copies were queued)."""
        self._kept.clear()
        self._kept_bytes = 0


def gathered(sources: list[Tensor]) -> Sequence[Tensor]:
    """`sources` itself, or a `GatheredSources` when any of them is an FSDP2 shard."""
    if any(isinstance(s, DTensor) for s in sources):
        return GatheredSources(sources)
    return sources
