"""DeepSeek-V4 attention over the engine's caches, a chunk of positions per row (prefill, a decode
or verify step, an MTP depth), reading `V4AttentionWeights` records.

Legend: A active rows, T tokens of one chunk, N key (cache) positions, D model dim, H query
heads, K head dim, O query low rank, Y compressed entries, I indexer heads, K2 rope pairs.
A compressor's rows (width K, or 2K in CSA) and a window's slots have no letter.

The math is the trainer's pure functions (model/v4_attention.py, v4_compressor.py); what
differs is where keys come from: the shared kv head in the static cache, masked to the window;
entries pooled from a per-layer ring of the last positions' projections and written where a
window completes (a rejected draft's entry is rewritten before anyone reads it). The rope
tables hold both V4 bases side by side ([N, 2*K2]: main | compress). Static shapes, no host
sync. Design notes: docs/v4.md, "Engine".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from birkhoff.config import ModelConfig, V4AttentionConfig
from birkhoff.engine.kv_cache import CompressorState, KVCache
from birkhoff.engine.layout import CompressorWeights, IndexerWeights, V4AttentionWeights
from birkhoff.engine.linear import linear, weight
from birkhoff.model.layers import rms_norm
from birkhoff.model.v4_attention import grouped_linear, sink_attention, v4_rope
from birkhoff.model.v4_compressor import (
    apply_partial_rope,
    index_scores,
    pool_windows,
    top_entries,
)

if TYPE_CHECKING:
    from birkhoff.engine.forward import Chunk


def v4_rope_tables(positions_N: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    """cos, sin [N, 2*K2] (fp64) of both V4 rope bases at `positions_N`: main | compress."""
    rope = v4_rope(positions_N[None], cfg)
    cos = torch.cat([rope.main[0], rope.compress[0]], dim=-1)[0]
    sin = torch.cat([rope.main[1], rope.compress[1]], dim=-1)[0]
    return cos, sin


def halves(chunk: Chunk) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The chunk's rope rows [A,T,K2] of the main base and of the compress base."""
    K2 = chunk.cos_ATK.shape[-1] // 2
    cos, sin = chunk.cos_ATK, chunk.sin_ATK
    return (cos[..., :K2], sin[..., :K2]), (cos[..., K2:], sin[..., K2:])


def rows_of(t_B: Tensor, chunk: Chunk) -> Tensor:
    """The chunk's rows of a per-cache-row tensor (a slice where the rows are 0..A-1)."""
    return t_B[: chunk.prefix_rows] if chunk.prefix_rows is not None else t_B[chunk.rows_A]


def v4_attention(
    x_ATD: Tensor,
    a: V4AttentionWeights[Tensor],
    cfg: ModelConfig,
    cache: KVCache,
    layer: int,
    chunk: Chunk,
    *,
    kernels: str,
) -> Tensor:
    """One V4 attention layer (sliding, CSA or HCA by its records) over a chunk -> [A,T,D];
    writes the chunk's kv head into the cache and, in compressed layers, their states."""
    v4 = cfg.attention
    assert isinstance(v4, V4AttentionConfig)
    A, T, _ = x_ATD.shape
    H, K, eps = cfg.num_heads, v4.head_dim, cfg.norm_eps
    main, compress = halves(chunk)
    tables = main if a.compressor is None else compress
    q_a, kv = linear(x_ATD, a.q_a_kv, kernels=kernels).split([v4.q_lora_rank, K], -1)
    q_res_ATO = rms_norm(q_a, a.q_a_norm, eps, kernels=kernels)
    q_AHTK = linear(q_res_ATO, a.q_b, kernels=kernels).view(A, T, H, K).transpose(1, 2)
    q_AHTK = apply_partial_rope(rms_norm(q_AHTK, None, eps), *tables)
    kv_A1TK = rms_norm(kv, a.kv_norm, eps, kernels=kernels)[:, None]
    kv_ATK = apply_partial_rope(kv_A1TK, *tables)[:, 0]
    cache.write(layer, chunk.rows_A, chunk.positions_AT, kv_ATK[:, :, None], kv_ATK[:, :, None])
    kv_ANK = rows_of(cache.k[layer, :, 0, : chunk.limit], chunk)
    allowed_ATN = window_mask(chunk, v4.sliding_window)
    if a.compressor is not None:
        entries_AYK, reads_ATY = compressed_keys(x_ATD, q_res_ATO, a, cfg, cache, layer, chunk)
        kv_ANK = torch.cat([kv_ANK, entries_AYK], dim=1)
        allowed_ATN = torch.cat([allowed_ATN, reads_ATY], dim=-1)
    out_ATHK = sink_attention(q_AHTK, kv_ANK, allowed_ATN, a.sinks, K**-0.5)
    cos, sin = tables
    out_ATHK = apply_partial_rope(out_ATHK.transpose(1, 2), cos, -sin).transpose(1, 2)
    o_ATR = grouped_linear(out_ATHK, weight(a.o_a, out_ATHK.dtype), v4.o_groups)
    return linear(o_ATR, a.o_b, kernels=kernels)


def window_mask(chunk: Chunk, window: int) -> Tensor:
    """[A,T,limit] bool: query at position p reads cache slots p - window < n <= p."""
    n_N = torch.arange(chunk.limit, device=chunk.positions_AT.device)
    p_AT1 = chunk.positions_AT[..., None]
    return (n_N <= p_AT1) & (n_N > p_AT1 - window)


def compressed_keys(
    x_ATD: Tensor,
    q_res_ATO: Tensor,
    a: V4AttentionWeights[Tensor],
    cfg: ModelConfig,
    cache: KVCache,
    layer: int,
    chunk: Chunk,
) -> tuple[Tensor, Tensor]:
    """(the layer's entries [A,Y,K] for Y = limit // ratio, which of them each query reads
    [A,T,Y]: the complete ones, in CSA the indexer's top-k of them); updates the states."""
    v4, states = cfg.attention, cache.compressed[layer]
    assert isinstance(v4, V4AttentionConfig) and states is not None and a.compressor is not None
    csa = a.indexer is not None
    ratio = v4.compress_rate_csa if csa else v4.compress_rate_hca
    compress(x_ATD, a.compressor, states.compressor, chunk, ratio, v4.head_dim, cfg, csa)
    Y = chunk.limit // ratio
    entries_AYK = rows_of(states.compressor.entries_BYK, chunk)[:, :Y]
    ready_AT1 = ((chunk.positions_AT + 1) // ratio)[..., None]
    visible_ATY = torch.arange(Y, device=x_ATD.device) < ready_AT1
    if a.indexer is None or Y == 0:
        return entries_AYK, visible_ATY
    assert states.indexer is not None
    ix, K = a.indexer, v4.index_head_dim
    compress(x_ATD, ix.compressor, states.indexer, chunk, ratio, K, cfg, True)
    keys_AYK = rows_of(states.indexer.entries_BYK, chunk)[:, :Y]
    scores_ATY = indexer_scores(x_ATD, q_res_ATO, ix, keys_AYK, chunk, K)
    return entries_AYK, top_entries(scores_ATY, visible_ATY, v4.index_topk)


def indexer_scores(
    x_ATD: Tensor,
    q_res_ATO: Tensor,
    ix: IndexerWeights[Tensor],
    keys_AYK: Tensor,
    chunk: Chunk,
    K: int,
) -> Tensor:
    """The lightning indexer's score of every entry for every query of the chunk [A,T,Y]."""
    A, T, _ = x_ATD.shape
    _, compress_rope = halves(chunk)
    q_AITK = linear(q_res_ATO, ix.q_b).view(A, T, -1, K).transpose(1, 2)
    q_ATIK = apply_partial_rope(q_AITK, *compress_rope).transpose(1, 2)
    return index_scores(q_ATIK, keys_AYK, linear(x_ATD, ix.weights_proj))


def window_rows(
    x_ATD: Tensor, c: CompressorWeights[Tensor], st: CompressorState, chunk: Chunk, span: int
) -> tuple[Tensor, Tensor]:
    """(kv_win, gate_win) [A,T,span,width]: the window of `span` positions ending at each chunk
    position, from the ring's rows before the chunk (value 0, gate -inf before position 0) and
    the chunk's own; the chunk's rows of its last `ring` real positions go into the ring."""
    ratio = c.position_bias.shape[0]
    kv, gate = linear(x_ATD, c.kv_gate).chunk(2, dim=-1)
    pos_AT = chunk.positions_AT
    gate = gate + c.position_bias[pos_AT % ratio]
    q_pos = pos_AT[:, :1] - span + torch.arange(span, device=pos_AT.device)  # before the chunk
    slot_prev, before = q_pos % st.ring, (q_pos >= 0)[..., None]
    kv_prev = torch.where(before, rows_of(st.ring_kv, chunk).gather(1, _idx(slot_prev, kv)), 0)
    gate_prev = rows_of(st.ring_gate, chunk).gather(1, _idx(slot_prev, gate))
    gate_prev = torch.where(before, gate_prev, float("-inf"))
    ext_kv = torch.cat([kv_prev, kv], dim=1)  # positions start - span .. start + T - 1
    ext_gate = torch.cat([gate_prev, gate], dim=1)
    # the window ending at chunk position t spans ext indices t+1 .. t+span
    kv_win = ext_kv.unfold(1, span, 1)[:, 1:].transpose(-1, -2)
    gate_win = ext_gate.unfold(1, span, 1)[:, 1:].transpose(-1, -2)
    last_A1 = torch.where(chunk.valid_AT, pos_AT, -1).amax(dim=1, keepdim=True)
    keep_AT = chunk.valid_AT & (pos_AT > last_A1 - st.ring)  # one write per ring slot
    slot_AT = torch.where(keep_AT, pos_AT % st.ring, st.ring)
    st.ring_kv[chunk.rows_A[:, None], slot_AT] = kv
    st.ring_gate[chunk.rows_A[:, None], slot_AT] = gate
    return kv_win, gate_win


def _idx(slot_prev: Tensor, like: Tensor) -> Tensor:
    """Gather indices of ring slots [A, slots] for rows as wide as `like`."""
    return slot_prev[..., None].expand(-1, -1, like.shape[-1])


def compress(
    x_ATD: Tensor,
    c: CompressorWeights[Tensor],
    st: CompressorState,
    chunk: Chunk,
    ratio: int,
    K: int,
    cfg: ModelConfig,
    overlap: bool,
) -> None:
    """Pool the window ending at every chunk position (CSA: [Ca of window w-1 | Cb of window w],
    2 * ratio slots), rope it at its window's first position and write it as entry
    (p + 1) // ratio - 1 where p completes a window (else into the trash entry)."""
    span = 2 * ratio if overlap else ratio
    kv_win, gate_win = window_rows(x_ATD, c, st, chunk, span)
    if overlap:  # the previous window's first half (Ca), this window's second half (Cb)
        kv_win = torch.cat([kv_win[:, :, :ratio, :K], kv_win[:, :, ratio:, K:]], dim=2)
        gate_win = torch.cat([gate_win[:, :, :ratio, :K], gate_win[:, :, ratio:, K:]], dim=2)
    entries_ATK = pool_windows(kv_win, gate_win, lambda e: rms_norm(e, c.norm, cfg.norm_eps))
    assert chunk.tables is not None, "V4 attention needs the chunk's rope tables"
    pos_AT = chunk.positions_AT
    first_AT = (pos_AT + 1 - ratio).clamp(min=0)
    K2 = chunk.tables[0].shape[-1] // 2
    cos, sin = (table[first_AT][..., K2:] for table in chunk.tables)
    entries_ATK = apply_partial_rope(entries_ATK[:, None], cos, sin)[:, 0]
    done_AT = chunk.valid_AT & ((pos_AT + 1) % ratio == 0)
    index_AT = torch.where(done_AT, (pos_AT + 1) // ratio - 1, st.trash)
    st.entries_BYK[chunk.rows_A[:, None], index_AT] = entries_ATK
