"""Main-model and MTP-depth forward passes over a KV cache, reading weights by name.

Legend: A active rows, T tokens of one chunk, N key (cache) positions, S streams, D model dim,
H query heads, G kv heads, K head dim, F MLP hidden, V vocab.

A chunk is T consecutive positions per active row, starting at a per-row position: prefill
(positions 0..P-1), a plain decode step (1 position), a verify step (k+1 positions) or an MTP
depth catching up on accepted positions. Rows with fewer than T real positions are padded; the
padded slots read and write the cache's trash slot and their outputs are ignored.

Numerics are the trainer's own pure functions from `birkhoff.model` (rms_norm, apply_rope,
swiglu_halves, hyper_connection, plain_residual, contract, single_stream,
expand_streams, mtp_merge; for MoE layers moe_ffn, through engine/moe.py): the engine
re-implements none of the model math, so an fp32 engine matches the trainer to rounding and a
fused kernel replaces an op in one place. Every such call passes `kernels=cfg.mhc_kernels`:
on CUDA ("auto") the mHC ops, RMSNorm, rope and SwiGLU run as fused Triton kernels (the per-token
ops forward-only: a step needs no gradient), elsewhere as the eager reference; a fused
hyper-connection enters its sublayer through `kernels.mhc.entry` (coefficients, mix in and
norm after the projection as one launch; H_post and H_res on a side stream beside F), and its
mix out also projects the new streams for the next entry's coefficients.
Attention is SDPA with an explicit mask `key position <= query position` over cache slots
0..limit-1; GQA uses SDPA's `enable_gqa` (kv head = query head // group, as the trainer's
repeat_interleave). With fused kernels, chunks of decode size (decode, verify and draft steps,
short prompts) rope q and k, write k and v into the cache and attend in one launch
(`kernels.attention.decode_attention_rope`: the same attention, reading each row's live prefix
in place); larger ones rope and write in one launch (`kernels.norm_rope.rope_cache`), then SDPA.
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
from birkhoff.engine.linear import linear
from birkhoff.engine.moe import moe_mlp
from birkhoff.kernels import use_fused
from birkhoff.model.hyper import (
    contract,
    expand_streams,
    hyper_connection,
    plain_residual,
    single_stream,
)
from birkhoff.model.layers import apply_rope, rms_norm, swiglu_halves
from birkhoff.model.mtp import mtp_merge

Weights = dict[str, Tensor]
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

    @functools.cached_property
    def mask_A1TN(self) -> Tensor:
        """key position <= query position, [A,1,T,limit]: built on first use (the SDPA path's;
        the fused decode attention reads positions instead)."""
        keys_N = torch.arange(self.limit, device=self.positions_AT.device)
        return (keys_N[None, None, :] <= self.positions_AT[:, :, None])[:, None]


def chunk_at(
    rows_A: Tensor, prefix_rows: int | None, positions_AT: Tensor, valid_AT: Tensor, *,
    rope: tuple[Tensor, Tensor], limit: int,
) -> Chunk:  # fmt: skip
    """The chunk of `positions_AT` (trash for padding) of cache rows `rows_A`, from device
    tensors only (no host sync: usable inside a CUDA graph capture)."""
    cos, sin = rope[0][positions_AT], rope[1][positions_AT]
    return Chunk(rows_A, prefix_rows, positions_AT, valid_AT, cos, sin, limit)


def read_cache(cache: KVCache, layer: int, chunk: Chunk) -> tuple[Tensor, Tensor]:
    k, v = cache.read(layer, chunk.limit)
    if chunk.prefix_rows is not None:
        return k[: chunk.prefix_rows], v[: chunk.prefix_rows]
    return k[chunk.rows_A], v[chunk.rows_A]


def attention(
    x_ATD: Tensor, w: Weights, prefix: str, cfg: ModelConfig, cache: KVCache, layer: int,
    chunk: Chunk,
) -> Tensor:  # fmt: skip
    A, T, _ = x_ATD.shape
    H, G, K, kernels = cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.mhc_kernels
    attn = prefix + "attn."
    # the fused projection (and bias): [A,T,H*K | G*K | G*K]
    qkv_bias = attn + "wqkv.bias" if cfg.qkv_bias else None
    qkv = linear(x_ATD, w, attn + "wqkv.weight", bias=qkv_bias, kernels=kernels)
    q, k, v = qkv.split([H * K, G * K, G * K], -1)
    q_ATHK, k_ATGK = q.view(A, T, H, K), k.view(A, T, G, K)
    if cfg.qk_norm:  # per-head RMSNorm over K, before rope (Qwen3)
        q_ATHK = rms_norm(q_ATHK, w[attn + "q_norm.weight"], cfg.norm_eps, kernels=kernels)
        k_ATGK = rms_norm(k_ATGK, w[attn + "k_norm.weight"], cfg.norm_eps, kernels=kernels)
    fused, v_ATGK = use_fused(q_ATHK, kernels), v.view(A, T, G, K)
    if fused and T * (H // G) <= DECODE_QUERIES:  # rope, cache write, attention: one launch
        from birkhoff.kernels.attention import decode_attention_rope

        k_BGNK, v_BGNK = cache.read(layer, chunk.limit)
        out_ATHK = decode_attention_rope(
            q_ATHK, k_ATGK, v_ATGK, chunk.cos_ATK, chunk.sin_ATK, k_BGNK, v_BGNK, chunk.rows_A,
            chunk.positions_AT, chunk.valid_AT, chunk.limit,
        )  # fmt: skip
    else:
        out_ATHK = rope_and_attend(q_ATHK, k_ATGK, v_ATGK, cache, layer, chunk, fused)
    out_bias = attn + "wo.bias" if cfg.attn_out_bias else None
    return linear(out_ATHK.reshape(A, T, H * K), w, attn + "wo.weight", bias=out_bias,
                  kernels=kernels)  # fmt: skip


def rope_and_attend(
    q_ATHK: Tensor, k_ATGK: Tensor, v_ATGK: Tensor, cache: KVCache, layer: int, chunk: Chunk,
    fused: bool,
) -> Tensor:  # fmt: skip
    """Rope, the cache write and SDPA over the cache: chunks beyond decode size (prefills), or
    eager."""
    H, G = q_ATHK.shape[2], k_ATGK.shape[2]
    if fused:  # one launch: rope of q and k, k and v into the cache
        from birkhoff.kernels.norm_rope import rope_cache

        k_BGNK, v_BGNK = cache.layer(layer)
        q_ATHK = rope_cache(q_ATHK, k_ATGK, v_ATGK, chunk.cos_ATK, chunk.sin_ATK, k_BGNK, v_BGNK,
                            chunk.rows_A, chunk.positions_AT)  # fmt: skip
    else:
        q_ATHK = apply_rope(q_ATHK, chunk.cos_ATK, chunk.sin_ATK, kernels="eager")
        k_ATGK = apply_rope(k_ATGK, chunk.cos_ATK, chunk.sin_ATK, kernels="eager")
        cache.write(layer, chunk.rows_A, chunk.positions_AT, k_ATGK, v_ATGK)
    k_AGNK, v_AGNK = read_cache(cache, layer, chunk)
    return F.scaled_dot_product_attention(
        q_ATHK.transpose(1, 2), k_AGNK, v_AGNK, attn_mask=chunk.mask_A1TN, enable_gqa=H != G
    ).transpose(1, 2)


def mlp(x_ATD: Tensor, w: Weights, prefix: str, kernels: str) -> Tensor:
    gate_up_ATF2 = linear(x_ATD, w, prefix + "mlp.w_gate_up.weight", kernels=kernels)
    h_ATF = swiglu_halves(gate_up_ATF2, kernels=kernels)
    return linear(h_ATF, w, prefix + "mlp.w_down.weight", kernels=kernels)


def feed_forward(x_ATD: Tensor, w: Weights, prefix: str, cfg: ModelConfig) -> Tensor:
    """The block's MLP: MoE where the layout serves a router (engine/moe.py), else SwiGLU."""
    if prefix + "mlp.router.weight" in w:
        return moe_mlp(x_ATD, w, prefix, cfg)
    return mlp(x_ATD, w, prefix, cfg.mhc_kernels)


Proj = tuple[Tensor, Tensor] | None  # an entry's projection partials, from the mix out before


def hyper(
    x_ATSD: Tensor, w: Weights, prefix: str, norm: str, cfg: ModelConfig,
    sublayer: Callable[[Tensor], Tensor], proj: Proj = None, next_hc: str | None = None,
) -> tuple[Tensor, Proj]:  # fmt: skip
    """One mHC-wrapped sublayer F(RMSNorm(.) * w[norm]) (S = 1: the plain residual), and the
    projection partials of its output for the hyper-connection `next_hc` (a weight prefix) that
    reads it next. With fused kernels the coefficients, mix in and norm are
    `mhc_entry.hyper_entry` (from `proj` where the previous mix out made it), whose H_post and
    H_res (the Sinkhorn) run on a side stream beside F, joined before mix out; mix out also
    projects the new streams for `next_hc` (`mhc_entry.mix_out_proj`). Elsewhere no partials."""

    def normed(h_ATD: Tensor) -> Tensor:
        return sublayer(rms_norm(h_ATD, w[norm], cfg.norm_eps, kernels=cfg.mhc_kernels))

    if cfg.num_streams == 1:
        return plain_residual(x_ATSD, normed), None
    phi, alpha, bias = w[prefix + "phi"], w[prefix + "alpha"], w[prefix + "bias"]
    iters, eps = cfg.sinkhorn_iters, cfg.mhc_eps
    if not use_fused(x_ATSD, cfg.mhc_kernels):
        return hyper_connection(x_ATSD, phi, alpha, bias, normed, iters=iters,
                                norm_eps=cfg.norm_eps, eps=eps, kernels="eager"), None  # fmt: skip
    from birkhoff.kernels import mhc
    from birkhoff.kernels.mhc import entry as mhc_entry

    side = side_stream(x_ATSD.device)
    x_ATSD, y_ATD, post, res, read = mhc_entry.hyper_entry(
        x_ATSD, phi, alpha, bias, w[norm], iters=iters, norm_eps=cfg.norm_eps, eps=eps,
        rms_eps=cfg.norm_eps, stream=side, proj=proj,
    )  # fmt: skip
    f_ATD = sublayer(y_ATD)
    if side is not None:
        torch.cuda.current_stream(x_ATSD.device).wait_stream(side)
    del read  # what the side stream reads is freed only after the join
    if next_hc is None:
        return mhc.mix_out(x_ATSD, f_ATD, post, res), None
    x_ATSD, part, sq = mhc_entry.mix_out_proj(x_ATSD, f_ATD, post, res, w[next_hc + "phi"])
    return x_ATSD, (part, sq)


@functools.cache
def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream `hyper` runs H_post and H_res on (one per CUDA device; None elsewhere)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def block(
    x_ATSD: Tensor, w: Weights, prefix: str, cfg: ModelConfig, cache: KVCache, layer: int,
    chunk: Chunk, proj: Proj, next_hc: str,
) -> tuple[Tensor, Proj]:  # fmt: skip
    """One block; `proj` and `next_hc` as `hyper` takes them, for its first and last entry."""
    x_ATSD, proj = hyper(
        x_ATSD, w, prefix + "hc_attn.", prefix + "attn_norm.weight", cfg,
        lambda h_ATD: attention(h_ATD, w, prefix, cfg, cache, layer, chunk), proj,
        prefix + "hc_mlp.",
    )  # fmt: skip
    return hyper(
        x_ATSD, w, prefix + "hc_mlp.", prefix + "mlp_norm.weight", cfg,
        lambda h_ATD: feed_forward(h_ATD, w, prefix, cfg), proj, next_hc,
    )  # fmt: skip


def contract_norm(
    x_ATSD: Tensor, w: Weights, prefix: str, cfg: ModelConfig, proj: Proj = None
) -> Tensor:
    """Output contraction of the streams, then the final norm: the lm_head input [A,T,D]."""
    norm = w[prefix + "norm.weight"]
    if cfg.num_streams == 1:
        return rms_norm(single_stream(x_ATSD), norm, cfg.norm_eps, kernels=cfg.mhc_kernels)
    phi, alpha, bias = (w[prefix + "contraction." + k] for k in ("phi", "alpha", "bias"))
    if use_fused(x_ATSD, cfg.mhc_kernels):
        from birkhoff.kernels.mhc import entry as mhc_entry

        return mhc_entry.contract_norm(
            x_ATSD, phi, alpha, bias, norm, norm_eps=cfg.norm_eps, eps=cfg.mhc_eps,
            rms_eps=cfg.norm_eps, proj=proj,
        )  # fmt: skip
    h_ATD = contract(x_ATSD, phi, alpha, bias, norm_eps=cfg.norm_eps, eps=cfg.mhc_eps,
                     kernels="eager")  # fmt: skip
    return rms_norm(h_ATD, norm, cfg.norm_eps, kernels=cfg.mhc_kernels)


def lm_head(h_AD: Tensor, w: Weights, cfg: ModelConfig) -> Tensor:
    """Logits [..., V] of hidden states [..., D] (any leading dims)."""
    name = "embed.weight" if cfg.tie_embeddings else "lm_head.weight"
    return linear(h_AD, w, name, kernels=cfg.mhc_kernels)


def main_forward(
    w: Weights, cfg: ModelConfig, cache: KVCache, tokens_AT: Tensor, chunk: Chunk
) -> tuple[Tensor, Tensor]:
    """(multistream [A,T,S,D], lm_head input [A,T,D]) of the main model; fills its cache."""
    # the embedding table widened to the streams (a view), gathered: the streams come out
    # contiguous in one launch, where embedding then expand made the first entry copy them
    x_ATSD = expand_streams(w["embed.weight"][None], cfg.num_streams)[0][tokens_AT]
    proj: Proj = None
    for i in range(L := cfg.num_layers):
        next_hc = f"layers.{i + 1}.hc_attn." if i + 1 < L else "contraction."
        x_ATSD, proj = block(x_ATSD, w, f"layers.{i}.", cfg, cache, i, chunk, proj, next_hc)
    return x_ATSD, contract_norm(x_ATSD, w, "", cfg, proj)


def mtp_forward(
    w: Weights, cfg: ModelConfig, depth: int, cache: KVCache, h_prev_ATSD: Tensor,
    tokens_AT: Tensor, chunk: Chunk,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Draft depth `depth` (0-based; beyond M-1 reuses the last depth's weights):
    h'_k = W_k [RMSNorm(h_{k-1}); RMSNorm(Emb(t_{i+k}))], one mHC block, own contraction + norm.
    Returns (h_k [A,T,S,D], lm_head input [A,T,D]); fills cache layer `depth`."""
    prefix = f"mtp.{min(depth, cfg.mtp_depth - 1)}."
    x_ATSD = mtp_merge(
        h_prev_ATSD, F.embedding(tokens_AT, w["embed.weight"]), w[prefix + "hidden_norm.weight"],
        w[prefix + "embed_norm.weight"], eps=cfg.norm_eps,
        project=lambda merged: linear(merged, w, prefix + "proj.weight", kernels=cfg.mhc_kernels),
        kernels=cfg.mhc_kernels,
    )  # fmt: skip
    x_ATSD, proj = block(x_ATSD, w, prefix + "block.", cfg, cache, depth, chunk, None,
                         prefix + "contraction.")  # fmt: skip
    return x_ATSD, contract_norm(x_ATSD, w, prefix, cfg, proj)


# --- the model passes of a step (engine/step.py adds chunks, sampling and acceptance) ---


def decode_step(
    w: Weights, cfg: ModelConfig, cache: KVCache, tokens_AT: Tensor, chunk: Chunk
) -> tuple[Tensor, Tensor]:
    """(multistream [A,T,S,D], logits [A,T,V]) of a plain (T = 1) or verify (T = J+1) step."""
    ms_ATSD, hidden_ATD = main_forward(w, cfg, cache, tokens_AT, chunk)
    return ms_ATSD, lm_head(hidden_ATD, w, cfg)
