"""Main-model and MTP-depth forward passes over a KV cache, reading typed weight records.

Legend: A active rows, T tokens of one chunk, N key (cache) positions, S streams, D model dim,
H query heads, G kv heads, K head dim, F MLP hidden, V vocab.

A chunk is T consecutive positions per active row from a per-row position (prefill, a decode or
verify step, an MTP depth catching up); padded slots read and write the cache's trash slot.
The numerics are `birkhoff.model`'s pure functions, so an fp32 engine matches the trainer to
rounding; `kernels` ("auto" | "eager" | "triton", the engine's option) picks their fused Triton
forms (docs/engine.md says which launch covers what). DeepSeek-V4 attention records go to
engine/v4_forward.py. Left out: paged attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.kv_cache import KVCache
from birkhoff.engine.layout import (
    AttentionWeights,
    BlockWeights,
    DenseWeights,
    DepthWeights,
    HeadWeights,
    HyperWeights,
    MoEWeights,
    V4AttentionWeights,
    Weights,
)
from birkhoff.engine.linear import linear
from birkhoff.engine.moe import moe_mlp
from birkhoff.engine.v4_forward import v4_attention
from birkhoff.kernels import mhc, use_fused
from birkhoff.kernels.attention import decode_attention_rope
from birkhoff.kernels.norm_rope import rope_cache
from birkhoff.model.hyper import (
    contract,
    expand_streams,
    hyper_connection,
    plain_residual,
    single_stream,
)
from birkhoff.model.layers import apply_rope, rms_norm, swiglu_halves
from birkhoff.model.mtp import mtp_merge

DECODE_QUERIES = 64  # query vectors per (row, kv head) up to which fused attention serves


@dataclass(frozen=True)
class Chunk:
    """Where one forward call reads and writes the caches."""

    rows_A: Tensor  # cache row of each active row
    prefix_rows: int | None  # rows_A == arange(A): read caches by slicing, no gather
    positions_AT: Tensor  # cache slot of each token (trash for padding)
    valid_AT: Tensor  # real (not padding) tokens
    cos_ATK: Tensor  # rope tables at the positions, [A,T,K/2]
    sin_ATK: Tensor
    limit: int  # keys are slots 0..limit-1
    tables: tuple[Tensor, Tensor] | None = None  # the whole rope tables (V4's compressors)

    @functools.cached_property
    def mask_A1TN(self) -> Tensor:
        """key position <= query position, [A,1,T,limit]: built on first use (the SDPA path's;
        the fused decode attention reads positions instead)."""
        keys_N = torch.arange(self.limit, device=self.positions_AT.device)
        return (keys_N[None, None, :] <= self.positions_AT[:, :, None])[:, None]


def chunk_at(
    rows_A: Tensor,
    prefix_rows: int | None,
    positions_AT: Tensor,
    valid_AT: Tensor,
    *,
    rope: tuple[Tensor, Tensor],
    limit: int,
) -> Chunk:
    """The chunk of `positions_AT` (trash for padding) of cache rows `rows_A`, from device
    tensors only (no host sync: usable inside a CUDA graph capture)."""
    cos, sin = rope[0][positions_AT], rope[1][positions_AT]
    return Chunk(rows_A, prefix_rows, positions_AT, valid_AT, cos, sin, limit, rope)


def read_cache(cache: KVCache, layer: int, chunk: Chunk) -> tuple[Tensor, Tensor]:
    k, v = cache.read(layer, chunk.limit)
    if chunk.prefix_rows is not None:
        return k[: chunk.prefix_rows], v[: chunk.prefix_rows]
    return k[chunk.rows_A], v[chunk.rows_A]


def attention(
    x_ATD: Tensor,
    a: AttentionWeights[Tensor],
    cfg: ModelConfig,
    cache: KVCache,
    layer: int,
    chunk: Chunk,
    *,
    kernels: str,
) -> Tensor:
    """Fused q/k/v projection, (q/k norm), rope, cache write, attention, o projection. Chunks of
    decode size do rope, cache write and attention in one fused launch."""
    A, T, _ = x_ATD.shape
    H, G, K = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    qkv = linear(x_ATD, a.qkv, kernels=kernels)  # [A,T,H*K | G*K | G*K]
    q, k, v = qkv.split([H * K, G * K, G * K], -1)
    q_ATHK, k_ATGK = q.view(A, T, H, K), k.view(A, T, G, K)
    if a.q_norm is not None and a.k_norm is not None:  # per-head RMSNorm, before rope (Qwen3)
        q_ATHK = rms_norm(q_ATHK, a.q_norm, cfg.norm_eps, kernels=kernels)
        k_ATGK = rms_norm(k_ATGK, a.k_norm, cfg.norm_eps, kernels=kernels)
    fused, v_ATGK = use_fused(q_ATHK, kernels), v.view(A, T, G, K)
    if fused and T * (H // G) <= DECODE_QUERIES:  # rope, cache write, attention: one launch
        k_BGNK, v_BGNK = cache.read(layer, chunk.limit)
        out_ATHK = decode_attention_rope(
            q_ATHK,
            k_ATGK,
            v_ATGK,
            chunk.cos_ATK,
            chunk.sin_ATK,
            k_BGNK,
            v_BGNK,
            chunk.rows_A,
            chunk.positions_AT,
            chunk.valid_AT,
            chunk.limit,
        )
    else:
        out_ATHK = rope_and_attend(q_ATHK, k_ATGK, v_ATGK, cache, layer, chunk, fused)
    return linear(out_ATHK.reshape(A, T, H * K), a.o, kernels=kernels)


def rope_and_attend(
    q_ATHK: Tensor,
    k_ATGK: Tensor,
    v_ATGK: Tensor,
    cache: KVCache,
    layer: int,
    chunk: Chunk,
    fused: bool,
) -> Tensor:
    """Rope, the cache write and SDPA over the cache (mask: key position <= query position;
    GQA through SDPA's enable_gqa): chunks beyond decode size (prefills), or eager."""
    H, G = q_ATHK.shape[2], k_ATGK.shape[2]
    if fused:  # one launch: rope of q and k, k and v into the cache
        k_BGNK, v_BGNK = cache.layer(layer)
        q_ATHK = rope_cache(
            q_ATHK,
            k_ATGK,
            v_ATGK,
            chunk.cos_ATK,
            chunk.sin_ATK,
            k_BGNK,
            v_BGNK,
            chunk.rows_A,
            chunk.positions_AT,
        )
    else:
        q_ATHK = apply_rope(q_ATHK, chunk.cos_ATK, chunk.sin_ATK, kernels="eager")
        k_ATGK = apply_rope(k_ATGK, chunk.cos_ATK, chunk.sin_ATK, kernels="eager")
        cache.write(layer, chunk.rows_A, chunk.positions_AT, k_ATGK, v_ATGK)
    k_AGNK, v_AGNK = read_cache(cache, layer, chunk)
    return F.scaled_dot_product_attention(
        q_ATHK.transpose(1, 2), k_AGNK, v_AGNK, attn_mask=chunk.mask_A1TN, enable_gqa=H != G
    ).transpose(1, 2)


def mlp(x_ATD: Tensor, m: DenseWeights[Tensor], *, kernels: str) -> Tensor:
    gate_up_ATF2 = linear(x_ATD, m.gate_up, kernels=kernels)
    h_ATF = swiglu_halves(gate_up_ATF2, kernels=kernels)
    return linear(h_ATF, m.down, kernels=kernels)


def feed_forward(
    x_ATD: Tensor,
    m: DenseWeights[Tensor] | MoEWeights[Tensor],
    cfg: ModelConfig,
    tokens_AT: Tensor | None = None,
    *,
    kernels: str,
) -> Tensor:
    """The block's MLP: MoE (engine/moe.py; hash layers route by `tokens_AT`) or SwiGLU."""
    if isinstance(m, MoEWeights):
        return moe_mlp(x_ATD, m, cfg, kernels=kernels, tokens_AT=tokens_AT)
    return mlp(x_ATD, m, kernels=kernels)


Proj = tuple[Tensor, Tensor] | None  # an entry's projection partials, from the mix out before


def hyper(
    x_ATSD: Tensor,
    hc: HyperWeights[Tensor] | None,
    norm_D: Tensor,
    cfg: ModelConfig,
    sublayer: Callable[[Tensor], Tensor],
    proj: Proj = None,
    next_hc: HyperWeights[Tensor] | None = None,
    *,
    kernels: str,
) -> tuple[Tensor, Proj]:
    """One mHC-wrapped sublayer F(RMSNorm(.) * norm) (S = 1: the plain residual), and the
    projection partials of its output for the hyper-connection `next_hc` that reads it next.
    With fused kernels the coefficients, mix in and norm are `mhc.hyper_entry` (from
    `proj` where the previous mix out made it), whose H_post and H_res (the Sinkhorn) run on a
    side stream beside F, joined before mix out; mix out also projects the new streams for
    `next_hc` (`mhc.mix_out_proj`). Elsewhere no partials."""

    def normed(h_ATD: Tensor) -> Tensor:
        return sublayer(rms_norm(h_ATD, norm_D, cfg.norm_eps, kernels=kernels))

    if hc is None:
        return plain_residual(x_ATSD, normed), None
    iters, eps = cfg.sinkhorn_iters, cfg.mhc_eps
    if not use_fused(x_ATSD, kernels):
        y_ATSD = hyper_connection(
            x_ATSD,
            hc.phi,
            hc.alpha,
            hc.bias,
            normed,
            iters=iters,
            norm_eps=cfg.norm_eps,
            eps=eps,
            kernels="eager",
        )
        return y_ATSD, None
    side = side_stream(x_ATSD.device)
    x_ATSD, y_ATD, post, res, read = mhc.hyper_entry(
        x_ATSD,
        hc.phi,
        hc.alpha,
        hc.bias,
        norm_D,
        iters=iters,
        norm_eps=cfg.norm_eps,
        eps=eps,
        rms_eps=cfg.norm_eps,
        stream=side,
        proj=proj,
    )
    f_ATD = sublayer(y_ATD)
    if side is not None:
        torch.cuda.current_stream(x_ATSD.device).wait_stream(side)
    del read  # what the side stream reads is freed only after the join
    if next_hc is None:
        return mhc.mix_out(x_ATSD, f_ATD, post, res), None
    x_ATSD, part, sq = mhc.mix_out_proj(x_ATSD, f_ATD, post, res, next_hc.phi)
    return x_ATSD, (part, sq)


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream `hyper` runs H_post and H_res on (one per CUDA device; None elsewhere)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def block(
    x_ATSD: Tensor,
    blk: BlockWeights[Tensor],
    cfg: ModelConfig,
    cache: KVCache,
    layer: int,
    chunk: Chunk,
    proj: Proj,
    next_hc: HyperWeights[Tensor] | None,
    tokens_AT: Tensor | None = None,
    *,
    kernels: str,
) -> tuple[Tensor, Proj]:
    """One block; `proj` and `next_hc` as `hyper` takes them, for its first and last entry;
    `tokens_AT`: the chunk's token ids (V4's hash-routed MoE layers route by them)."""
    a = blk.attn

    def attend(h_ATD: Tensor) -> Tensor:
        if isinstance(a, V4AttentionWeights):
            return v4_attention(h_ATD, a, cfg, cache, layer, chunk, kernels=kernels)
        return attention(h_ATD, a, cfg, cache, layer, chunk, kernels=kernels)

    def ffn(h_ATD: Tensor) -> Tensor:
        return feed_forward(h_ATD, blk.mlp, cfg, tokens_AT, kernels=kernels)

    x_ATSD, proj = hyper(
        x_ATSD, blk.hc_attn, blk.attn_norm, cfg, attend, proj, blk.hc_mlp, kernels=kernels
    )
    return hyper(x_ATSD, blk.hc_mlp, blk.mlp_norm, cfg, ffn, proj, next_hc, kernels=kernels)


def contract_norm(
    x_ATSD: Tensor,
    head: HeadWeights[Tensor],
    cfg: ModelConfig,
    proj: Proj = None,
    *,
    kernels: str,
) -> Tensor:
    """Output contraction of the streams, then the final norm: the lm_head input [A,T,D]."""
    c = head.contraction
    if c is None:
        return rms_norm(single_stream(x_ATSD), head.norm, cfg.norm_eps, kernels=kernels)
    if use_fused(x_ATSD, kernels):
        return mhc.contract_norm(
            x_ATSD,
            c.phi,
            c.alpha,
            c.bias,
            head.norm,
            norm_eps=cfg.norm_eps,
            eps=cfg.mhc_eps,
            rms_eps=cfg.norm_eps,
            proj=proj,
        )
    h_ATD = contract(
        x_ATSD, c.phi, c.alpha, c.bias, norm_eps=cfg.norm_eps, eps=cfg.mhc_eps, kernels="eager"
    )
    return rms_norm(h_ATD, head.norm, cfg.norm_eps, kernels=kernels)


def lm_head(h_AD: Tensor, w: Weights, *, kernels: str) -> Tensor:
    """Logits [..., V] of hidden states [..., D] (any leading dims)."""
    return linear(h_AD, w.lm_head, kernels=kernels)


def main_forward(
    w: Weights,
    cfg: ModelConfig,
    cache: KVCache,
    tokens_AT: Tensor,
    chunk: Chunk,
    *,
    kernels: str,
) -> tuple[Tensor, Tensor]:
    """(multistream [A,T,S,D], lm_head input [A,T,D]) of the main model; fills its cache."""
    # the embedding table widened to the streams (a view), gathered: the streams come out
    # contiguous in one launch, where embedding then expand made the first entry copy them
    x_ATSD = expand_streams(w.embed[None], cfg.num_streams)[0][tokens_AT]
    proj: Proj = None
    next_hcs = [blk.hc_attn for blk in w.layers[1:]] + [w.head.contraction]
    for i, (blk, next_hc) in enumerate(zip(w.layers, next_hcs, strict=True)):
        x_ATSD, proj = block(
            x_ATSD, blk, cfg, cache, i, chunk, proj, next_hc, tokens_AT, kernels=kernels
        )
    return x_ATSD, contract_norm(x_ATSD, w.head, cfg, proj, kernels=kernels)


def mtp_weights(w: Weights, depth: int) -> DepthWeights[Tensor]:
    """Draft depth `depth`'s weights (0-based; beyond M-1 the last depth's)."""
    return w.mtp[min(depth, len(w.mtp) - 1)]


def mtp_input(
    w: Weights,
    cfg: ModelConfig,
    depth: int,
    h_prev_ATSD: Tensor,
    tokens_AT: Tensor,
    *,
    kernels: str,
) -> Tensor:
    """h'_k = W_k [RMSNorm(h_{k-1}); RMSNorm(Emb(t_{i+k}))] [A,T,S,D] of draft depth `depth`
    (`model.mtp.mtp_merge`; `kernels.step_inputs.depth_inputs` fuses what precedes W_k)."""
    d = mtp_weights(w, depth)
    return mtp_merge(
        h_prev_ATSD,
        F.embedding(tokens_AT, w.embed),
        d.hidden_norm,
        d.embed_norm,
        eps=cfg.norm_eps,
        project=lambda merged: linear(merged, d.proj, kernels=kernels),
        kernels=kernels,
    )


def mtp_forward(
    w: Weights,
    cfg: ModelConfig,
    depth: int,
    cache: KVCache,
    x_ATSD: Tensor,
    chunk: Chunk,
    *,
    kernels: str,
) -> tuple[Tensor, Tensor]:
    """Draft depth `depth` (0-based) on its merged input h'_k (`mtp_input`): one mHC block, its
    own contraction + norm. Returns (h_k [A,T,S,D], lm_head input [A,T,D]); fills cache layer
    `depth`."""
    d = mtp_weights(w, depth)
    x_ATSD, proj = block(
        x_ATSD, d.block, cfg, cache, depth, chunk, None, d.head.contraction, kernels=kernels
    )
    return x_ATSD, contract_norm(x_ATSD, d.head, cfg, proj, kernels=kernels)


# --- the model passes of a step (engine/step.py adds chunks, sampling and acceptance) ---


def decode_step(
    w: Weights,
    cfg: ModelConfig,
    cache: KVCache,
    tokens_AT: Tensor,
    chunk: Chunk,
    *,
    kernels: str,
) -> tuple[Tensor, Tensor]:
    """(multistream [A,T,S,D], logits [A,T,V]) of a plain (T = 1) or verify (T = J+1) step."""
    ms_ATSD, hidden_ATD = main_forward(w, cfg, cache, tokens_AT, chunk, kernels=kernels)
    return ms_ATSD, lm_head(hidden_ATD, w, kernels=kernels)
