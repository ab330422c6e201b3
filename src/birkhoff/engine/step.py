"""The steps a generation runs on the device: prefill, plain decode, and draft + verify + accept.

Legend: A rows of a step, J drafts per step, T tokens of a chunk (plain: 1; verify: J+1),
V vocab, S streams, D model dim, B cache rows, N cache positions.

A step is a pure function of persistent tensors (`StepContext`: weights, caches, the rows'
tokens, keys and sampling parameters) and a small per-row state tensor the host writes: it
builds its chunk, runs the model, samples, writes its tokens into `tokens_BN` and returns one
fp64 result row per row, with static shapes and no host sync, so graphs.py replays it as one
CUDA graph (eagerly it is the reference). Rows that hold no request touch only the trash slot.
What each step reads and advances, and the speculative step's draft lengths: docs/engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.forward import (
    Chunk,
    chunk_at,
    decode_step,
    lm_head,
    main_forward,
    mtp_forward,
    mtp_input,
    mtp_weights,
)
from birkhoff.engine.kv_cache import DrafterState, KVCache
from birkhoff.engine.layout import Weights
from birkhoff.engine.linear import linear
from birkhoff.engine.rng import ACCEPT, DRAFT, SAMPLE, TAGS
from birkhoff.engine.rows import RowState
from birkhoff.engine.sampling import SiteRows, sample_site, sample_tokens
from birkhoff.engine.speculative import accept_drafts
from birkhoff.kernels import use_fused


@dataclass(frozen=True, slots=True)
class StepContext:
    """What a step reads and writes besides its per-row state (all allocated once)."""

    w: Weights
    cfg: ModelConfig
    kernels: str  # the engine's kernel choice (`birkhoff.kernels.use_fused`)
    cache: KVCache
    drafter: DrafterState | None
    rows: RowState
    rope: tuple[Tensor, Tensor]
    num_drafts: int
    filtered: bool  # some row of the step samples with top-k / top-p
    draft_lengths: tuple[int, ...] = ()  # positions per depth; () = J + k (static shapes)


def fused_sampling(ctx: StepContext, logits: Tensor) -> bool:
    """Whether a sampling site runs as one fused launch: fused kernels, logits the kernels take
    (not fp64), and no row of the step filtering with top-k / top-p (that keeps the eager
    sort)."""
    fused_dtype = logits.dtype != torch.float64
    return use_fused(logits, ctx.kernels) and fused_dtype and not ctx.filtered


def sample_at(
    ctx: StepContext,
    rows_A: Tensor,
    n_A: Tensor,
    live_A: Tensor,
    logits_AV: Tensor,
    tag: int,
    offset: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """`sampling.sample_site` on the step's rows and tables: ([A, 2] fp64 of (token, its
    logprob), the tokens [A], the probs [A, V] they were drawn from)."""
    rows = ctx.rows
    site = SiteRows(rows_A, n_A, live_A, rows.sampling, rows.rng, rows.tokens_BN, ctx.cache.trash)
    fused = fused_sampling(ctx, logits_AV)
    return sample_site(logits_AV, site, tag, offset, fused=fused, filtered=ctx.filtered)


def step_chunk(
    ctx: StepContext,
    rows_A: Tensor,
    prefix: int | None,
    start_A: Tensor | None,
    end_A: Tensor | None,
    live_A: Tensor,
    T: int,
    limit: int,
    shift: int = 0,
) -> tuple[Chunk, Tensor]:
    """(the chunk of positions p = start + t, t < T (start 0 where None) of rows `rows_A`, real
    where live and p < end (no bound where None), padding on the trash slot; the tokens at
    p + shift, the trash slot's where padding). With fused kernels: one launch
    (`kernels.step_inputs`)."""
    trash, tokens_BN = ctx.cache.trash, ctx.rows.tokens_BN
    if use_fused(live_A, ctx.kernels):
        from birkhoff.kernels.step_inputs import chunk_inputs

        slots_AT, valid_AT, cos, sin, tokens_AT = chunk_inputs(
            start_A, end_A, live_A, rows_A, tokens_BN, *ctx.rope, trash, T, shift
        )
        return Chunk(rows_A, prefix, slots_AT, valid_AT, cos, sin, limit), tokens_AT
    pos_AT = torch.arange(T, device=rows_A.device).expand(len(rows_A), T)
    if start_A is not None:
        pos_AT = start_A[:, None] + pos_AT
    valid_AT = live_A.bool()[:, None].expand(len(rows_A), T)
    if end_A is not None:
        valid_AT = valid_AT & (pos_AT < end_A[:, None])
    slots_AT = torch.where(valid_AT, pos_AT, trash)
    chunk = chunk_at(rows_A, prefix, slots_AT, valid_AT, rope=ctx.rope, limit=limit)
    return chunk, tokens_BN[rows_A[:, None], torch.where(valid_AT, pos_AT + shift, trash)]


def plain_step(
    ctx: StepContext, rows_A: Tensor, prefix: int | None, state_KA: Tensor, limit: int
) -> Tensor:
    """One plain decode step (state [2, A]: n, live): [A, 2] fp64 of (next token, logprob)."""
    n_A, live_A = state_KA[0], state_KA[1]
    chunk, tokens_A1 = step_chunk(ctx, rows_A, prefix, n_A, None, live_A, 1, limit)
    _, logits_A1V = decode_step(ctx.w, ctx.cfg, ctx.cache, tokens_A1, chunk, kernels=ctx.kernels)
    return sample_at(ctx, rows_A, n_A, chunk.valid_AT[:, 0], logits_A1V[:, 0], SAMPLE, 1)[0]


def prefill_step(
    ctx: StepContext, rows_A: Tensor, prefix: int | None, state_KA: Tensor, limit: int
) -> Tensor:
    """Prefill (state [2, A]: prompt length L, live): the main model over positions 0..L-1 of
    each live row (its prompt, already in tokens_BN) as one chunk of T = limit positions, the
    multistream into the drafter's depth-0 buffer, and the token after the prompt sampled at
    pending position L - 1, as `plain_step` returns it: [A, 2] fp64 of (token, logprob)."""
    len_A, live_A = state_KA[0], state_KA[1].bool()
    chunk, tokens_AT = step_chunk(ctx, rows_A, prefix, None, len_A, live_A, limit, limit)
    ms_ATSD, hidden_ATD = main_forward(
        ctx.w, ctx.cfg, ctx.cache, tokens_AT, chunk, kernels=ctx.kernels
    )
    if ctx.drafter is not None:
        ctx.drafter.streams.write(0, rows_A, chunk.positions_AT, ms_ATSD)
    last_A = (len_A - 1).clamp(min=0)
    hidden_AD = hidden_ATD[torch.arange(len(rows_A), device=rows_A.device), last_A]
    logits_AV = lm_head(hidden_AD, ctx.w, kernels=ctx.kernels)
    return sample_at(ctx, rows_A, last_A, live_A, logits_AV, SAMPLE, 1)[0]


def depth_chunk(
    ctx: StepContext,
    rows_A: Tensor,
    prefix: int | None,
    k: int,
    start_A: Tensor | None,
    end_A: Tensor,
    live_A: Tensor,
    T: int,
    limit: int,
) -> tuple[Chunk, Tensor, Tensor]:
    """(draft depth k's chunk as `step_chunk` builds it with bound `end` and token shift k, its
    merged input h'_k [A,T,S,D] (`forward.mtp_input`), the chunk offset of position end - 1
    [A], clamped to 0..T-1). With fused kernels: one launch (`kernels.step_inputs`) before
    the merge's projection."""
    assert ctx.drafter is not None
    if use_fused(live_A, ctx.kernels):
        from birkhoff.kernels.step_inputs import depth_inputs

        d = mtp_weights(ctx.w, k - 1)
        slots_AT, valid_AT, cos, sin, merge_in, last_A = depth_inputs(
            start_A,
            end_A,
            live_A,
            rows_A,
            ctx.rows.tokens_BN,
            *ctx.rope,
            ctx.drafter.streams.h[k - 1],
            ctx.w.embed,
            d.hidden_norm,
            d.embed_norm,
            ctx.cfg.norm_eps,
            ctx.cache.trash,
            T,
            k,
        )
        chunk = Chunk(rows_A, prefix, slots_AT, valid_AT, cos, sin, limit)
        return chunk, linear(merge_in, d.proj, kernels=ctx.kernels), last_A
    chunk, tokens_AT = step_chunk(ctx, rows_A, prefix, start_A, end_A, live_A, T, limit, k)
    h_prev_ATSD = ctx.drafter.streams.read(k - 1, rows_A, chunk.positions_AT)
    x_ATSD = mtp_input(ctx.w, ctx.cfg, k - 1, h_prev_ATSD, tokens_AT, kernels=ctx.kernels)
    last_A = end_A - 1 if start_A is None else end_A - 1 - start_A
    return chunk, x_ATSD, last_A.clamp(0, T - 1)


def depth_pass(
    ctx: StepContext,
    rows_A: Tensor,
    prefix: int | None,
    k: int,
    start_A: Tensor | None,
    end_A: Tensor,
    live_A: Tensor,
    T: int,
    limit: int,
) -> tuple[Tensor, Tensor]:
    """Draft depth k over cache positions start..start+T-1 (start 0 where None) that are below
    `end` in live rows (the rest pads onto the trash slot): reads h_{k-1} there, embeds t_{j+k}
    at position j, fills depth k's cache and, below the last depth, stores h_k. Returns (the
    lm_head input [A,T,D], the chunk offset of position end - 1 [A])."""
    assert ctx.drafter is not None
    chunk, x_ATSD, last_A = depth_chunk(ctx, rows_A, prefix, k, start_A, end_A, live_A, T, limit)
    h_ATSD, head_ATD = mtp_forward(
        ctx.w, ctx.cfg, k - 1, ctx.drafter.cache, x_ATSD, chunk, kernels=ctx.kernels
    )
    if k < ctx.num_drafts:
        ctx.drafter.streams.write(k, rows_A, chunk.positions_AT, h_ATSD)
    return head_ATD, last_A


def catch_up_step(
    ctx: StepContext, rows_A: Tensor, prefix: int | None, state_KA: Tensor, limit: int
) -> Tensor:
    """A new request's draft depths over its prompt (state [2, A]: pending position n, live):
    depth k runs positions 0..n-k-1 (everything it can see from accepted tokens but its last
    k positions) as one chunk of T = limit positions, so a later step recomputes at most J + k.
    Returns [A, 1] fp64: the positions depth 1 ran."""
    n_A, live_A = state_KA[0], state_KA[1].bool()
    for k in range(1, ctx.num_drafts + 1):
        depth_pass(ctx, rows_A, prefix, k, None, n_A - k, live_A, limit, limit)
    return torch.where(live_A, n_A - 1, 0).clamp(min=0).double()[:, None]


def draft(
    ctx: StepContext,
    rows_A: Tensor,
    prefix: int | None,
    n_A: Tensor,
    live_A: Tensor,
    limit: int,
) -> tuple[Tensor, Tensor]:
    """(drafts [A,J], their distributions q [A,J,V]): depth k recomputes its positions from
    valid_JB[k-1] up to n-1 and drafts t_{n+k} from position n-1 (written to tokens_BN)."""
    assert ctx.drafter is not None
    J, valid_JB = ctx.num_drafts, ctx.drafter.valid_JB
    drafts, qs = [], []
    for k in range(1, J + 1):
        start_A = valid_JB[k - 1, :prefix] if prefix is not None else valid_JB[k - 1, rows_A]
        T = ctx.draft_lengths[k - 1] if ctx.draft_lengths else J + k
        # last: the chunk offset of position n-1
        head_ATD, last_A = depth_pass(ctx, rows_A, prefix, k, start_A, n_A, live_A, T, limit)
        at_A1D = last_A[:, None, None].expand(-1, 1, head_ATD.shape[-1])
        logits_AV = lm_head(head_ATD.gather(1, at_A1D)[:, 0], ctx.w, kernels=ctx.kernels)
        _, draft_A, q_AV = sample_at(ctx, rows_A, n_A, live_A, logits_AV, DRAFT + k, k)
        drafts.append(draft_A)
        qs.append(q_AV)
    return torch.stack(drafts, dim=1), torch.stack(qs, dim=1)


def verify(
    ctx: StepContext,
    rows_A: Tensor,
    prefix: int | None,
    n_A: Tensor,
    live_A: Tensor,
    drafts_AJ: Tensor,
    q_AJV: Tensor,
    limit: int,
) -> Tensor:
    """The main model on [t_n, d_1..d_J] at positions n..n+J, then acceptance; returns [A, 1 +
    2T] fp64: the accepted drafts a, the T emitted tokens, their logprobs (the first a + 1 are
    real). The next token goes to tokens_BN at n + 1 + a; for live rows, depth k's first
    position to recompute becomes max(0, n - k + 1) (positions <= n - k used accepted tokens
    only) and n becomes n + 1 + a: the next step's inputs, on the device. With fused kernels and
    no row filtering, everything after the model pass is one launch (`kernels.accept`)."""
    assert ctx.drafter is not None
    (A, J), T, trash = drafts_AJ.shape, drafts_AJ.shape[1] + 1, ctx.cache.trash
    tokens_BN = ctx.rows.tokens_BN
    chunk, tokens_AT = step_chunk(ctx, rows_A, prefix, n_A, None, live_A, T, limit)
    ms_ATSD, logits_ATV = decode_step(
        ctx.w, ctx.cfg, ctx.cache, tokens_AT, chunk, kernels=ctx.kernels
    )
    ctx.drafter.streams.write(0, rows_A, chunk.positions_AT, ms_ATSD)
    if fused_sampling(ctx, logits_ATV):
        from birkhoff.kernels.accept import verify_accept

        table = ctx.rows.sampling.params
        return verify_accept(
            logits_ATV,
            q_AJV,
            drafts_AJ,
            rows_A,
            n_A,
            live_A,
            table.temperature_A,
            table.greedy_A,
            ctx.rows.rng.keys_R,
            tokens_BN,
            ctx.rows.n_B,
            ctx.drafter.valid_JB,
            trash,
            TAGS,
            SAMPLE,
            ACCEPT,
        )[1]
    rs = ctx.rows.sampling.select(rows_A, T, filtered=ctx.filtered)
    logp_AV, p_AV, _ = sample_tokens(logits_ATV.reshape(A * T, -1), rs, None)
    tags_J = ACCEPT + torch.arange(1, J + 1, device=rows_A.device)
    u_AJ = ctx.rows.rng.uniform(rows_A[:, None], n_A[:, None], tags_J[None, :])
    u_A = ctx.rows.rng.uniform(rows_A, n_A, SAMPLE)
    num_acc_A, next_A = accept_drafts(p_AV.view(A, T, -1), q_AJV, drafts_AJ, u_AJ, u_A)
    tokens_BN[rows_A, torch.where(live_A, n_A + 1 + num_acc_A, trash)] = next_A
    emitted_AT = torch.cat((drafts_AJ, next_A[:, None]), dim=1)
    emitted_AT[torch.arange(A, device=rows_A.device), num_acc_A] = next_A
    logp_AT = logp_AV.view(A, T, -1).gather(-1, emitted_AT[..., None]).squeeze(-1)
    depth_J1 = torch.arange(1, J + 1, device=rows_A.device)[:, None]  # the next step's inputs
    valid_JA = ctx.drafter.valid_JB[:J, rows_A]
    ctx.drafter.valid_JB[:J, rows_A] = torch.where(
        live_A, (n_A - depth_J1 + 1).clamp(min=0), valid_JA
    )
    ctx.rows.n_B[rows_A] = torch.where(live_A, n_A + 1 + num_acc_A, n_A)
    return torch.cat((num_acc_A[:, None].double(), emitted_AT.double(), logp_AT.double()), dim=1)


def speculative_step(
    ctx: StepContext, rows_A: Tensor, prefix: int | None, state_KA: Tensor, limit: int
) -> Tensor:
    """Draft, verify, accept: one step of every row of `rows_A` (state [1, A]: live; see
    `verify` for the result and the state it advances)."""
    assert ctx.drafter is not None
    live_A = state_KA[0].bool()
    n_B = ctx.rows.n_B  # rows 0..A-1 (prefix): read in place; verify writes them only at its end
    n_A = n_B[:prefix] if prefix is not None else n_B[rows_A]
    drafts_AJ, q_AJV = draft(ctx, rows_A, prefix, n_A, live_A, limit)
    return verify(ctx, rows_A, prefix, n_A, live_A, drafts_AJ, q_AJV, limit)
