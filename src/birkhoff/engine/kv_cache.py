"""Static, preallocated decode state: K/V caches and the MTP drafter's stream buffers.

Legend: L layers, B batch rows, G kv heads, N capacity (cache positions), K head dim,
A active rows, T tokens of one chunk, J draft depths, S streams, D model dim.

K and V are [L, B, G, N, K]; slot p of row b holds position p of sequence b, so rolling back
rejected drafts is only a matter of the row's length (stale slots are masked, then
overwritten). The last slot (`trash`) is never read and takes padded chunk slots. The drafter
has one cache layer per draft depth and one stream buffer per depth input (`streams[k]` holds
h_k per position), since depth k+1 recomputes positions from an earlier round. Details:
docs/engine.md.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """K/V for `num_layers` attention layers of `batch` rows and `capacity` positions."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity

    @property
    def trash(self) -> int:
        return self.capacity - 1

    def write(
        self, layer: int, rows_A: Tensor, positions_AT: Tensor, k_ATGK: Tensor, v_ATGK: Tensor
    ) -> None:
        # advanced indices around a slice put the broadcast [A,T] dims first: [A,T,G,K]
        self.k[layer][rows_A[:, None], :, positions_AT] = k_ATGK
        self.v[layer][rows_A[:, None], :, positions_AT] = v_ATGK

    def layer(self, layer: int) -> tuple[Tensor, Tensor]:
        """K, V [B,G,N,K] of one layer, as views (fused kernels read and write them in place)."""
        return self.k[layer], self.v[layer]

    def read(self, layer: int, limit: int) -> tuple[Tensor, Tensor]:
        """K, V [B,G,limit,K] of positions 0..limit-1, as views (no copy)."""
        assert limit < self.capacity, f"read limit {limit} reaches the trash slot"
        return self.k[layer, :, :, :limit], self.v[layer, :, :, :limit]


class StreamBuffer:
    """Per-position multistream states h_0..h_{J-1} of the draft depths: [J, B, N, S, D]."""

    def __init__(
        self,
        num_depths: int,
        batch: int,
        capacity: int,
        num_streams: int,
        dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_depths, batch, capacity, num_streams, dim)
        self.h = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, depth: int, rows_A: Tensor, positions_AT: Tensor, h_ATSD: Tensor) -> None:
        self.h[depth][rows_A[:, None], positions_AT] = h_ATSD

    def read(self, depth: int, rows_A: Tensor, positions_AT: Tensor) -> Tensor:
        return self.h[depth][rows_A[:, None], positions_AT]


class DrafterState:
    """The MTP drafter's caches and stream buffers for J chained depths, and per depth and
    cache row the first position a step recomputes (`valid_JB`: the positions before it were
    computed from accepted tokens only). Speculative steps keep it on the device (step.py)."""

    def __init__(self, cache: KVCache, streams: StreamBuffer) -> None:
        self.cache, self.streams = cache, streams
        J, B = cache.k.shape[0], cache.k.shape[1]
        self.valid_JB = torch.zeros(J, B, dtype=torch.long, device=cache.k.device)
