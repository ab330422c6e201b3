"""Speculative decoding: exact acceptance of MTP drafts, and its statistics.

Legend: A rows of a step, J drafts per step, T = J+1 verified positions, V vocab, S streams,
D model dim.

Drafting (see decode.py): depth k at the last accepted position i sees h_{k-1} at i and
Emb(t_{i+k}) and proposes t_{i+k+1}, exactly as the MTP depths are trained; drafts beyond the
model's M depths reuse the last depth, chained on its own output streams.

Acceptance (`accept_drafts`, Leviathan et al. / Chen et al.): with q_j the distribution draft j was
sampled from and p_j the main model's distribution at the same position, accept draft x_j with
probability min(1, p_j(x)/q_j(x)), left to right; at the first rejection sample from
norm(max(0, p_j - q_j)); if all J are accepted, sample a bonus token from p_J. Every emitted token
is then distributed exactly as p, so speculative and plain sampling agree in distribution. For
greedy rows p and q are one-hot at the argmax, so the same rule is argmax agreement, and the
emitted tokens are exactly the greedy tokens.

The step (`speculative_step` = `verify` after `draft`) runs on the device from static shapes
only, so it is one CUDA graph (graphs.py) with no host sync inside: its per-row state is a
[J+2, A] tensor (pending position n, live flag, the first position each depth recomputes), and
depth k always covers J + k positions from its first invalid one (after a step that emitted
a + 1 tokens it has a + k <= J + k to redo; `Generation.admit` catches a new request's depths up
on its prompt first), padding the rest onto the trash slot. Rows of a graph's batch bucket that
hold no request are not live: they compute on the trash slot and their outputs are dropped.
The host reads one [A, 1 + 2T] result per step (accepted count, emitted tokens, logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.forward import Weights, chunk_at, decode_step, draft_step
from birkhoff.engine.kv_cache import DrafterState, KVCache
from birkhoff.engine.rng import ACCEPT, DRAFT, SAMPLE, sample_inverse_cdf
from birkhoff.engine.rows import RowState
from birkhoff.engine.sampling import sample_logits


def accept_drafts(
    p_ATV: Tensor, q_AJV: Tensor, drafts_AJ: Tensor, u_AJ: Tensor, u_A: Tensor
) -> tuple[Tensor, Tensor]:
    """(number of accepted drafts [A], the next token [A]) by exact rejection sampling.

    p_ATV: target probabilities at the T = J+1 verified positions;
    q_AJV: draft probabilities; drafts_AJ: the drafted tokens (sampled from q);
    u_AJ: uniforms of the acceptance tests; u_A: the uniform that samples the next token.
    """
    A, J = drafts_AJ.shape
    p_draft_AJ = p_ATV[:, :J].gather(-1, drafts_AJ[..., None]).squeeze(-1)
    q_draft_AJ = q_AJV.gather(-1, drafts_AJ[..., None]).squeeze(-1)
    ok_AJ = u_AJ * q_draft_AJ < p_draft_AJ  # u < p/q without dividing; q(x) > 0 as x ~ q
    num_accepted_A = ok_AJ.long().cumprod(dim=1).sum(dim=1)
    rows_A = torch.arange(A, device=p_ATV.device)
    p_next_AV = p_ATV[rows_A, num_accepted_A]
    # q is zero past the last draft, so with everything accepted the residual is p_J itself
    q_padded_ATV = torch.cat((q_AJV, torch.zeros_like(q_AJV[:, :1])), dim=1)
    residual_AV = (p_next_AV - q_padded_ATV[rows_A, num_accepted_A]).clamp_min(0)
    # rounding can empty the residual where p ~ q (then rejection had ~zero probability)
    empty_A1 = residual_AV.sum(dim=-1, keepdim=True) <= 0
    residual_AV = torch.where(empty_A1, p_next_AV, residual_AV)
    return num_accepted_A, sample_inverse_cdf(residual_AV, u_A)


@dataclass(frozen=True, slots=True)
class SpecContext:
    """What a speculative step reads and writes besides its per-row state (all persistent)."""

    w: Weights
    cfg: ModelConfig
    cache: KVCache
    drafter: DrafterState
    rows: RowState
    rope: tuple[Tensor, Tensor]
    num_drafts: int
    filtered: bool  # some row of the step samples with top-k / top-p


def state_rows(n: list[int], live: list[int], valid: list[list[int]]) -> list[list[int]]:
    """The [J+2, A] state of a step: pending positions, live flags, each depth's first
    position to recompute."""
    return [n, live, *valid]


def draft(
    ctx: SpecContext, rows_A: Tensor, prefix: int | None, state_KA: Tensor, limit: int
) -> tuple[Tensor, Tensor]:
    """(drafts [A,J], their distributions q [A,J,V]): depth k recomputes its positions from
    state_KA[1 + k] up to n-1 and drafts t_{n+k} from position n-1 (written to tokens_BN)."""
    J, trash, device = ctx.num_drafts, ctx.cache.trash, rows_A.device
    n_A, live_A, tokens_BN = state_KA[0], state_KA[1].bool(), ctx.rows.tokens_BN
    rs = ctx.rows.sampling.select(rows_A, filtered=ctx.filtered)
    drafts, qs = [], []
    for k in range(1, J + 1):
        start_A, T = state_KA[1 + k], J + k
        pos_AT = start_A[:, None] + torch.arange(T, device=device)
        ok_AT = live_A[:, None] & (pos_AT < n_A[:, None])
        positions_AT = torch.where(ok_AT, pos_AT, trash)
        chunk = chunk_at(rows_A, prefix, positions_AT, ok_AT, rope=ctx.rope, limit=limit)
        # depth k at position j embeds t_{j+k}; padding reads slot 0 (ignored)
        tokens_AT = tokens_BN[rows_A[:, None], torch.where(ok_AT, pos_AT + k, 0)]
        h_prev_ATSD = ctx.drafter.streams.read(k - 1, rows_A, positions_AT)
        last_A = (n_A - 1 - start_A).clamp(0, T - 1)  # the offset of position n-1
        h_ATSD, logits_AV = draft_step(
            ctx.w, ctx.cfg, k - 1, ctx.drafter.cache, h_prev_ATSD, tokens_AT, chunk, last_A
        )
        if k < J:
            ctx.drafter.streams.write(k, rows_A, positions_AT, h_ATSD)
        _, q_AV = sample_logits(logits_AV, rs)
        draft_A = ctx.rows.rng.sample(q_AV, rows_A, n_A, DRAFT + k)
        tokens_BN[rows_A, torch.where(live_A, n_A + k, trash)] = draft_A
        drafts.append(draft_A)
        qs.append(q_AV)
    return torch.stack(drafts, dim=1), torch.stack(qs, dim=1)


def verify(
    ctx: SpecContext, rows_A: Tensor, prefix: int | None, state_KA: Tensor, drafts_AJ: Tensor,
    q_AJV: Tensor, limit: int,
) -> Tensor:  # fmt: skip
    """The main model on [t_n, d_1..d_J] at positions n..n+J, then acceptance; returns
    [A, 1 + 2T] fp64: accepted drafts a, the T emitted tokens, their logprobs (the first a + 1
    are real). The next token goes to tokens_BN at n + 1 + a."""
    (A, J), T, trash = drafts_AJ.shape, drafts_AJ.shape[1] + 1, ctx.cache.trash
    n_A, live_A, tokens_BN = state_KA[0], state_KA[1].bool(), ctx.rows.tokens_BN
    pos_AT = n_A[:, None] + torch.arange(T, device=rows_A.device)
    live_AT = live_A[:, None].expand(A, T)
    positions_AT = torch.where(live_AT, pos_AT, trash)
    chunk = chunk_at(rows_A, prefix, positions_AT, live_AT, rope=ctx.rope, limit=limit)
    tokens_AT = tokens_BN[rows_A[:, None], torch.where(live_AT, pos_AT, 0)]
    ms_ATSD, logits_ATV = decode_step(ctx.w, ctx.cfg, ctx.cache, tokens_AT, chunk)
    ctx.drafter.streams.write(0, rows_A, positions_AT, ms_ATSD)
    rs = ctx.rows.sampling.select(rows_A, T, filtered=ctx.filtered)
    logp_AV, p_AV = sample_logits(logits_ATV.reshape(A * T, -1), rs)  # A*T rows
    tags_J = ACCEPT + torch.arange(1, J + 1, device=rows_A.device)
    u_AJ = ctx.rows.rng.uniform(rows_A[:, None], n_A[:, None], tags_J[None, :])
    u_A = ctx.rows.rng.uniform(rows_A, n_A, SAMPLE)
    num_acc_A, next_A = accept_drafts(p_AV.view(A, T, -1), q_AJV, drafts_AJ, u_AJ, u_A)
    tokens_BN[rows_A, torch.where(live_A, n_A + 1 + num_acc_A, trash)] = next_A
    emitted_AT = torch.cat((drafts_AJ, next_A[:, None]), dim=1)
    emitted_AT[torch.arange(A, device=rows_A.device), num_acc_A] = next_A
    logp_AT = logp_AV.view(A, T, -1).gather(-1, emitted_AT[..., None]).squeeze(-1)
    return torch.cat((num_acc_A[:, None].double(), emitted_AT.double(), logp_AT.double()), dim=1)


def speculative_step(
    ctx: SpecContext, rows_A: Tensor, prefix: int | None, state_KA: Tensor, limit: int
) -> Tensor:
    """Draft, verify, accept: one step of every row of `rows_A` (see `verify` for the result)."""
    drafts_AJ, q_AJV = draft(ctx, rows_A, prefix, state_KA, limit)
    return verify(ctx, rows_A, prefix, state_KA, drafts_AJ, q_AJV, limit)


@dataclass(slots=True)
class SpecStats:
    """Acceptance statistics of one generate call (counted per row and verify step)."""

    num_drafts: int
    num_steps: int = 0  # verify steps, summed over rows
    num_emitted: int = 0  # tokens produced by verify steps (accepted drafts + 1 each)
    accepted_at: list[int] = field(default_factory=list)  # per draft position j: steps accepting j

    def __post_init__(self) -> None:
        if not self.accepted_at:
            self.accepted_at = [0] * self.num_drafts

    def record(self, num_accepted: list[int]) -> None:
        for a in num_accepted:
            self.num_steps += 1
            self.num_emitted += a + 1
            for j in range(a):
                self.accepted_at[j] += 1

    @property
    def acceptance_rate(self) -> list[float]:
        """Per draft position j (1-based in prose): P(drafts 1..j all accepted) per step."""
        return [n / max(self.num_steps, 1) for n in self.accepted_at]

    @property
    def conditional_acceptance_rate(self) -> list[float]:
        """P(draft j accepted | drafts 1..j-1 accepted)."""
        reached = [self.num_steps, *self.accepted_at[:-1]]
        return [n / max(r, 1) for n, r in zip(self.accepted_at, reached, strict=True)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the corrected/bonus token)."""
        return self.num_emitted / max(self.num_steps, 1)
