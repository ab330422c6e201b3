"""Static, preallocated decode state: K/V caches and the MTP drafter's stream buffers.

Legend: L layers, B batch rows, G kv heads, N capacity (cache positions), K head dim,
A active rows, T tokens of one chunk, J draft depths, S streams, D model dim, Y compressed
entries.

K and V are [L, B, G, N, K]; slot p of row b holds position p of sequence b, so rolling back
rejected drafts is only a matter of the row's length (stale slots are masked, then
overwritten). The last slot (`trash`) is never read and takes padded chunk slots. The drafter
has one cache layer per draft depth and one stream buffer per depth input (`streams[k]` holds
h_k per position), since depth k+1 recomputes positions from an earlier round. Details:
docs/engine.md. DeepSeek-V4 (docs/v4.md, "Engine"): one shared head read as both K and V
(`shared`: `v` is `k`, half the bytes) and, per CSA / HCA layer, a `CompressorState`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from birkhoff.config import ModelConfig


class CompressorState:
    """A V4 compressor's decode state for `batch` rows: its entries [B, Y+1, K] (entry w at index
    w; the last index is the trash entry) and a ring of the projected kv and gate rows of the
    last `ring` positions ([B, ring+1, width]: position p at p % ring, the last slot trash), which
    the windows still completing read. `ring` covers a window's span plus the positions a
    rejected verify chunk may have overwritten (engine/v4_forward.py)."""

    def __init__(
        self,
        batch: int,
        entries: int,
        head_dim: int,
        width: int,
        ring: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.entries_BYK = torch.zeros(batch, entries + 1, head_dim, dtype=dtype, device=device)
        self.ring_kv = torch.zeros(batch, ring + 1, width, dtype=dtype, device=device)
        self.ring_gate = torch.zeros(batch, ring + 1, width, dtype=dtype, device=device)
        self.ring = ring

    @property
    def trash(self) -> int:
        """The trash entry's index (the ring's trash slot is `ring`)."""
        return self.entries_BYK.shape[1] - 1


class LayerCompression(NamedTuple):
    """A compressed layer's states: its compressor's, and in CSA layers its indexer's."""

    compressor: CompressorState
    indexer: CompressorState | None


class KVCache:
    """K/V for `num_layers` attention layers of `batch` rows and `capacity` positions (`shared`:
    one tensor read as both), and the compressed layers' states (`compressed`, per layer)."""

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
        shared: bool = False,
        compressed: tuple[LayerCompression | None, ...] = (),
    ) -> None:
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = self.k if shared else torch.zeros(shape, dtype=dtype, device=device)
        self.capacity, self.compressed = capacity, compressed

    @property
    def trash(self) -> int:
        return self.capacity - 1

    def write(
        self, layer: int, rows_A: Tensor, positions_AT: Tensor, k_ATGK: Tensor, v_ATGK: Tensor
    ) -> None:
        # advanced indices around a slice put the broadcast [A,T] dims first: [A,T,G,K]
        self.k[layer][rows_A[:, None], :, positions_AT] = k_ATGK
        if self.v is not self.k:
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


def compression_states(
    cfg: ModelConfig,
    batch: int,
    capacity: int,
    max_speculative_tokens: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[LayerCompression | None, ...]:
    """Per main layer of a V4 config: the compressor (and CSA indexer) states of its kind, None
    for sliding layers. A ring holds a window's span (2 * ratio in CSA) plus the J + 1 positions
    of a verify chunk, so a rejected chunk never overwrites a slot the next chunk reads."""
    v4 = cfg.attention
    assert v4 is not None
    states: list[LayerCompression | None] = []
    for kind in v4.layer_types:
        csa = kind == "compressed_sparse_attention"
        if not csa and kind != "heavily_compressed_attention":
            states.append(None)
            continue
        ratio = v4.compress_rate_csa if csa else v4.compress_rate_hca
        ring = (2 * ratio if csa else ratio) + max_speculative_tokens + 1
        entries = capacity // ratio

        def state(K: int, width: int, ring: int = ring, entries: int = entries) -> CompressorState:
            return CompressorState(batch, entries, K, width, ring, dtype=dtype, device=device)

        K, width = v4.head_dim, (2 if csa else 1) * v4.head_dim
        indexer = state(v4.index_head_dim, 2 * v4.index_head_dim) if csa else None
        states.append(LayerCompression(state(K, width), indexer))
    return tuple(states)
