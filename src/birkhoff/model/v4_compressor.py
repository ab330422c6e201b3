"""DeepSeek-V4's compressed attention branches: the compressors and the CSA indexer.

Legend: B batch, T tokens, D model dim, K head dim (the indexer's: index_head_dim), Y compressed
entries, I indexer heads, O query low rank, K2 rope pairs (qk_rope_head_dim / 2).

A compressor turns every complete window of `ratio` tokens into one key/value entry: a softmax
over the window's tokens (gate logits + a learned per-slot bias), per channel, weights the
projected values; the sum is RMS-normed and roped at the window's first position. HCA windows
do not overlap; CSA projects two series (Ca | Cb, 2K wide) and entry w pools window w's Cb with
window w-1's Ca (2 * ratio slots, stride ratio). Query t may read entry w once its window is
complete ((w + 1) * ratio <= t + 1); in CSA only the `index_topk` entries the indexer scores
highest. Full-sequence (training / prefill) path only: decode state (partial windows, the Ca
carried over) is the engine's. The indexer is not trained by the language-model loss (its picks
are indices); V4 trains it with a separate distillation loss, left out here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from birkhoff.config import ModelConfig, V4AttentionConfig
from birkhoff.model.layers import RMSNorm, _compute_dtype


def apply_partial_rope(x_BHTK: Tensor, cos_BTK2: Tensor, sin_BTK2: Tensor) -> Tensor:
    """V4's rope: rotate the pairs (2i, 2i+1) of the trailing 2 * K2 channels of each head (axis 1
    of x holds heads or is 1) by the position angle; the leading channels pass unchanged."""
    pairs = cos_BTK2.shape[-1]
    dtype = _compute_dtype(x_BHTK.dtype)
    cos, sin = cos_BTK2.to(dtype)[:, None], sin_BTK2.to(dtype)[:, None]
    nope, rope = x_BHTK[..., : -2 * pairs], x_BHTK[..., -2 * pairs :]
    rope_pairs = rope.to(dtype).unflatten(-1, (pairs, 2))
    x1, x2 = rope_pairs[..., 0], rope_pairs[..., 1]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x_BHTK.dtype)], dim=-1)


def window_chunks(x: Tensor, ratio: int) -> Tensor:
    """The complete windows of `ratio` tokens of x [B,T,width]: [B, Y = T // ratio, ratio, width]
    (a partial tail is dropped: its entry is not complete before the sequence ends)."""
    B, T, width = x.shape
    Y = T // ratio
    return x[:, : Y * ratio].view(B, Y, ratio, width)


def overlapping_windows(kv_windows: Tensor, gate_windows: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """CSA's 2 * ratio slots per entry: [Ca of window w-1 | Cb of window w], from the two
    series kv[..., :K] (Ca) and kv[..., K:] (Cb). Entry 0 has no previous window: its first
    slots hold value 0 and gate -inf (weight 0)."""
    B, Y, m, _ = kv_windows.shape
    kv = kv_windows.new_zeros((B, Y, 2 * m, K))
    gate = gate_windows.new_full((B, Y, 2 * m, K), float("-inf"))
    kv[:, :, m:] = kv_windows[..., K:]
    gate[:, :, m:] = gate_windows[..., K:]
    if Y > 1:
        kv[:, 1:, :m] = kv_windows[:, :-1, :, :K]
        gate[:, 1:, :m] = gate_windows[:, :-1, :, :K]
    return kv, gate


def pool_windows(kv_slots: Tensor, gate_slots: Tensor, norm: Callable[[Tensor], Tensor]) -> Tensor:
    """One entry per window: norm(sum over slots (dim 2) of softmax(gate) * kv) -> [B,Y,K]
    (`norm`: the compressor's RMSNorm)."""
    weights = gate_slots.softmax(dim=2, dtype=_compute_dtype(gate_slots.dtype))
    return norm((kv_slots * weights.to(kv_slots.dtype)).sum(dim=2))


def entry_positions(Y: int, ratio: int, table_BTK2: Tensor) -> Tensor:
    """Rows of a rope table at the entries' positions w * ratio (their windows' first token)."""
    return table_BTK2[:, : Y * ratio : ratio]


def visible_entries(T: int, Y: int, ratio: int, device: torch.device) -> Tensor:
    """[T,Y] bool: query t reads entry w once its window is complete, (w+1) * ratio <= t + 1."""
    ready_T = (torch.arange(T, device=device) + 1) // ratio
    return torch.arange(Y, device=device)[None, :] < ready_T[:, None]


class Compressor(nn.Module):
    """The compressor of an HCA layer: non-overlapping windows of `compress_rate_hca`. With
    `overlap`, the pooling of CSA (2K-wide projections, see `overlapping_windows`)."""

    def __init__(self, dim: int, K: int, ratio: int, *, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * K if overlap else K
        self.ratio, self.head_dim, self.overlap = ratio, K, overlap
        self.kv_proj = nn.Linear(dim, width, bias=False)
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(K, eps)

    def entries(self, x_BTD: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """The roped entries [B,Y,K] of x's complete windows."""
        kv_windows = window_chunks(self.kv_proj(x_BTD), self.ratio)
        gate_windows = window_chunks(self.gate_proj(x_BTD), self.ratio) + self.position_bias
        if self.overlap:
            kv_windows, gate_windows = overlapping_windows(kv_windows, gate_windows, self.head_dim)
        entries_BYK = pool_windows(kv_windows, gate_windows, self.kv_norm)
        Y = entries_BYK.shape[1]
        cos, sin = (entry_positions(Y, self.ratio, table) for table in rope)
        return apply_partial_rope(entries_BYK[:, None], cos, sin)[:, 0]

    def forward(
        self, x_BTD: Tensor, q_res_BTO: Tensor, rope: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """(entries [B,Y,K], which entries each query reads [T,Y] bool)."""
        entries_BYK = self.entries(x_BTD, rope)
        T, Y = x_BTD.shape[1], entries_BYK.shape[1]
        return entries_BYK, visible_entries(T, Y, self.ratio, x_BTD.device)


def index_scores(q_BTIK: Tensor, keys_BYK: Tensor, weights_BTI: Tensor) -> Tensor:
    """The lightning indexer's score of entry y for query t: sum_i w_ti ReLU(q_ti . k_y)
    (q.k scaled by K^-1/2, w by I^-1/2), in >= fp32 -> [B,T,Y]."""
    dtype = _compute_dtype(q_BTIK.dtype)
    num_heads, K = q_BTIK.shape[-2:]
    dots_BTIY = torch.matmul(q_BTIK.to(dtype), keys_BYK.transpose(-1, -2).to(dtype)[:, None])
    scores_BTIY = F.relu(dots_BTIY) * K**-0.5
    w_BTI = weights_BTI.to(dtype) * num_heads**-0.5
    return (scores_BTIY * w_BTI[..., None]).sum(dim=2)


def top_entries(scores_BTY: Tensor, visible: Tensor, k: int) -> Tensor:
    """[B,T,Y] bool: the (at most) k visible entries of highest score for each query (`visible`:
    [T,Y], or [B,T,Y] where rows differ, as in the engine)."""
    B, T, Y = scores_BTY.shape
    scores_BTY = scores_BTY.masked_fill(~visible, float("-inf"))
    picks = scores_BTY.topk(min(k, Y), dim=-1).indices  # [B,T,min(k,Y)]
    visible_picks = visible.expand(B, T, Y).gather(-1, picks)  # too-early picks: dropped
    picked = torch.zeros(B, T, Y + 1, dtype=torch.bool, device=scores_BTY.device)
    return picked.scatter_(-1, torch.where(visible_picks, picks, Y), True)[..., :Y]


class IndexScorer(nn.Module):
    """Holds the indexer's per-head weight projection (transformers' `indexer.scorer`)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(dim, num_heads, bias=False)


class Indexer(Compressor):
    """CSA's lightning indexer: an overlapping compressor of its own at index_head_dim, queries
    from the attention's low-rank query (the q_a_norm output), the top-k entries per query."""

    def __init__(self, cfg: ModelConfig, v4: V4AttentionConfig) -> None:
        K, ratio = v4.index_head_dim, v4.compress_rate_csa
        super().__init__(cfg.dim, K, ratio, overlap=True, eps=cfg.norm_eps)
        self.num_heads, self.topk = v4.index_n_heads, v4.index_topk
        self.q_b_proj = nn.Linear(v4.q_lora_rank, v4.index_n_heads * K, bias=False)
        self.scorer = IndexScorer(cfg.dim, v4.index_n_heads)

    @torch.no_grad()
    def forward(
        self, x_BTD: Tensor, q_res_BTO: Tensor, rope: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """(its keys [B,Y,K], the entries each query reads [B,T,Y] bool); no gradient flows
        through a choice of indices."""
        B, T, _ = x_BTD.shape
        keys_BYK, visible_TY = super().forward(x_BTD, q_res_BTO, rope)
        q_BITK = self.q_b_proj(q_res_BTO).view(B, T, self.num_heads, -1).transpose(1, 2)
        q_BTIK = apply_partial_rope(q_BITK, *rope).transpose(1, 2)
        scores_BTY = index_scores(q_BTIK, keys_BYK, self.scorer.weights_proj(x_BTD))
        return keys_BYK, top_entries(scores_BTY, visible_TY, self.topk)


class SparseCompressor(Compressor):
    """The compressor of a CSA layer: overlapping windows of `compress_rate_csa`, each query
    reading only the entries its indexer picks."""

    def __init__(self, cfg: ModelConfig, v4: V4AttentionConfig) -> None:
        super().__init__(cfg.dim, v4.head_dim, v4.compress_rate_csa, overlap=True, eps=cfg.norm_eps)
        self.indexer = Indexer(cfg, v4)

    def forward(
        self, x_BTD: Tensor, q_res_BTO: Tensor, rope: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """(entries [B,Y,K], the indexer's picks [B,T,Y] bool)."""
        _, picked_BTY = self.indexer(x_BTD, q_res_BTO, rope)
        return self.entries(x_BTD, rope), picked_BTY


def build_compressor(cfg: ModelConfig, layer_type: str) -> Compressor | None:
    """The compressor of a layer of kind `layer_type` (None: sliding window only)."""
    v4 = cfg.attention
    assert v4 is not None
    if layer_type == "compressed_sparse_attention":
        return SparseCompressor(cfg, v4)
    if layer_type == "heavily_compressed_attention":
        ratio = v4.compress_rate_hca
        return Compressor(cfg.dim, v4.head_dim, ratio, overlap=False, eps=cfg.norm_eps)
    return None
