"""One generate call: prefill, then plain or speculative decode steps until every row is done.

Legend: A active rows, B batch rows, T tokens of a chunk, N cache positions, J drafts per step,
S streams, D model dim, V vocab.

Per-row bookkeeping is host-side: `n[i]` is the position of row i's pending token (sampled but
not yet run through the main model; the main cache is valid for positions < n[i]) and, per draft
depth k, `valid[k][i]` counts the leading positions whose depth-k cache entries were computed
from accepted tokens only. A speculative step:
  1. draft: depth k recomputes positions valid[k][i] .. n[i]-1 (the newly accepted ones, plus
     those that had used drafts as inputs) and proposes t_{n+k} from position n-1;
  2. verify: the main model runs on [t_n, d_1..d_J] at positions n..n+J;
  3. accept a_i drafts and sample one more token; n[i] += a_i + 1.
Rolling back is implicit: cache slots past a row's valid length are masked and later overwritten.
Finished rows leave the active set, so the batch shrinks as sequences stop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.forward import Chunk, Weights, lm_head, main_forward, make_chunk, mtp_forward
from birkhoff.engine.kv_cache import DrafterState, KVCache
from birkhoff.engine.sampling import (
    RowSampling,
    SamplingParams,
    sample,
    sampling_probs,
    target_logprobs,
)
from birkhoff.engine.speculative import SpecStats, accept_drafts


@dataclass(frozen=True, slots=True)
class Completion:
    tokens: list[int]  # generated tokens, prompt excluded (a stop token is included)
    logprobs: list[float]  # of each token under the distribution it was sampled from
    weight_version: int  # the engine weights that produced it
    finish_reason: str  # "stop" (stop token) | "length" (max_new_tokens or max_seq_len)


class Generation:
    """The state of one generate call over cache rows 0..len(prompts)-1."""

    def __init__(
        self, *, cfg: ModelConfig, weights: Weights, cache: KVCache, drafter: DrafterState | None,
        rope: tuple[Tensor, Tensor], prompts: list[list[int]], params: list[SamplingParams],
        max_seq_len: int, generator: torch.Generator,
    ) -> None:  # fmt: skip
        self.cfg, self.w, self.cache, self.drafter, self.rope = cfg, weights, cache, drafter, rope
        self.prompts, self.params, self.max_seq_len = prompts, params, max_seq_len
        self.generator, self.device = generator, cache.k.device
        self.sampling = RowSampling.build(params, self.device)
        B = len(prompts)
        self.tokens_BN = torch.zeros(B, cache.capacity, dtype=torch.long, device=self.device)
        self.n = [len(p) - 1 for p in prompts]  # prefill runs the last prompt token too
        self.num_drafts = params[0].num_speculative_tokens
        self.valid = [[0] * B for _ in range(self.num_drafts)]
        self.out_tokens: list[list[int]] = [[] for _ in range(B)]
        self.out_logprobs: list[list[float]] = [[] for _ in range(B)]
        self.finish: list[str | None] = [None] * B
        self.stats = SpecStats(self.num_drafts)

    def run(self) -> list[Completion]:
        self.prefill()
        while active := [i for i, f in enumerate(self.finish) if f is None]:
            if self.num_drafts:
                self.speculative_step(active)
            else:
                self.plain_step(active)
        return [
            Completion(toks, lps, -1, reason or "length")
            for toks, lps, reason in zip(
                self.out_tokens, self.out_logprobs, self.finish, strict=True
            )
        ]

    def chunk(self, rows: list[int], starts: list[int], lengths: list[int]) -> Chunk:
        return make_chunk(
            rows, starts, lengths, trash=self.cache.trash, rope=self.rope, device=self.device
        )

    def sample_logits(
        self, logits_AV: Tensor, rows_A: Tensor, repeat: int = 1
    ) -> tuple[Tensor, Tensor]:
        """(log-probs of the target distribution, sampling probs) for rows repeated `repeat`x."""
        rs = self.sampling.select(rows_A, repeat)
        logp_AV = target_logprobs(logits_AV, rs)
        return logp_AV, sampling_probs(logp_AV, rs.greedy_A)

    def prefill(self) -> None:
        rows = list(range(len(self.prompts)))
        chunk = self.chunk(rows, [0] * len(rows), [n + 1 for n in self.n])
        tokens_AT = torch.zeros(chunk.valid_AT.shape, dtype=torch.long)
        for i, prompt in enumerate(self.prompts):
            tokens_AT[i, : len(prompt)] = torch.tensor(prompt)
        tokens_AT = tokens_AT.to(self.device)
        self.tokens_BN[:, : tokens_AT.shape[1]] = tokens_AT
        ms_ATSD, hidden_ATD = main_forward(self.w, self.cfg, self.cache, tokens_AT, chunk)
        if self.drafter is not None:
            self.drafter.streams.write(0, chunk.rows_A, chunk.positions_AT, ms_ATSD)
        last_A = torch.tensor(self.n, device=self.device)
        self.sample_next(rows, chunk.rows_A, hidden_ATD[chunk.rows_A, last_A])

    def plain_step(self, rows: list[int]) -> None:
        chunk = self.chunk(rows, [self.n[i] for i in rows], [1] * len(rows))
        tokens_AT = self.tokens_BN[chunk.rows_A[:, None], chunk.positions_AT]
        _, hidden_ATD = main_forward(self.w, self.cfg, self.cache, tokens_AT, chunk)
        self.sample_next(rows, chunk.rows_A, hidden_ATD[:, 0])

    def sample_next(self, rows: list[int], rows_A: Tensor, hidden_AD: Tensor) -> None:
        logp_AV, probs_AV = self.sample_logits(lm_head(hidden_AD, self.w, self.cfg), rows_A)
        next_A = sample(probs_AV, self.generator)
        n_A = torch.tensor([self.n[i] for i in rows], device=self.device)
        self.tokens_BN[rows_A, n_A + 1] = next_A
        logp_A = logp_AV.gather(-1, next_A[:, None]).squeeze(-1)
        for i, tok, lp in zip(rows, next_A.tolist(), logp_A.tolist(), strict=True):
            self.emit(i, [tok], [lp])

    def emit(self, i: int, tokens: list[int], logprobs: list[float]) -> None:
        """Append tokens to row i until a stop token, max_new_tokens or max_seq_len."""
        p, out = self.params[i], self.out_tokens[i]
        for tok, lp in zip(tokens, logprobs, strict=True):
            out.append(tok)
            self.out_logprobs[i].append(lp)
            if tok in p.stop_token_ids:
                self.finish[i] = "stop"
            elif (
                len(out) >= p.max_new_tokens or len(self.prompts[i]) + len(out) >= self.max_seq_len
            ):
                self.finish[i] = "length"
            if self.finish[i] is not None:
                return
        self.n[i] += len(tokens)

    def draft(self, rows: list[int], rows_A: Tensor) -> tuple[Tensor, Tensor]:
        """(drafts [A,J], their distributions q [A,J,V]) from the MTP depths at position n-1."""
        assert self.drafter is not None
        n_A = torch.tensor([self.n[i] for i in rows], device=self.device)
        drafts, qs = [], []
        for k in range(1, self.num_drafts + 1):
            starts = [self.valid[k - 1][i] for i in rows]
            chunk = self.chunk(
                rows, starts, [self.n[i] - s for i, s in zip(rows, starts, strict=True)]
            )
            # depth k at position j embeds t_{j+k}; padding reads slot 0 (ignored)
            token_pos_AT = torch.where(chunk.valid_AT, chunk.positions_AT + k, 0)
            tokens_AT = self.tokens_BN[rows_A[:, None], token_pos_AT]
            h_prev_ATSD = self.drafter.streams.read(k - 1, rows_A, chunk.positions_AT)
            h_ATSD, head_ATD = mtp_forward(
                self.w, self.cfg, k - 1, self.drafter.cache, h_prev_ATSD, tokens_AT, chunk
            )
            if k < self.num_drafts:
                self.drafter.streams.write(k, rows_A, chunk.positions_AT, h_ATSD)
            last_A = n_A - 1 - torch.tensor(starts, device=self.device)
            logits_AV = lm_head(
                head_ATD[torch.arange(len(rows), device=self.device), last_A], self.w, self.cfg
            )
            _, q_AV = self.sample_logits(logits_AV, rows_A)
            draft_A = sample(q_AV, self.generator)
            self.tokens_BN[rows_A, n_A + k] = draft_A
            drafts.append(draft_A)
            qs.append(q_AV)
            for i in rows:  # positions j <= n-k used accepted tokens only
                self.valid[k - 1][i] = max(0, self.n[i] - k + 1)
        return torch.stack(drafts, dim=1), torch.stack(qs, dim=1)

    def speculative_step(self, rows: list[int]) -> None:
        J = self.num_drafts
        rows_A = torch.tensor(rows, device=self.device)
        drafts_AJ, q_AJV = self.draft(rows, rows_A)
        assert self.drafter is not None
        chunk = self.chunk(rows, [self.n[i] for i in rows], [J + 1] * len(rows))
        tokens_AT = self.tokens_BN[rows_A[:, None], chunk.positions_AT]
        ms_ATSD, hidden_ATD = main_forward(self.w, self.cfg, self.cache, tokens_AT, chunk)
        self.drafter.streams.write(0, rows_A, chunk.positions_AT, ms_ATSD)
        A, T, V = len(rows), J + 1, self.cfg.vocab_size
        logits_AV = lm_head(hidden_ATD, self.w, self.cfg).reshape(A * T, V)  # A*T rows
        logp_AV, p_AV = self.sample_logits(logits_AV, rows_A, repeat=T)
        num_acc_A, next_A = accept_drafts(p_AV.view(A, T, V), q_AJV, drafts_AJ, self.generator)
        n_A = torch.tensor([self.n[i] for i in rows], device=self.device)
        self.tokens_BN[rows_A, n_A + 1 + num_acc_A] = next_A
        emitted_AT = torch.cat((drafts_AJ, next_A[:, None]), dim=1)
        emitted_AT[torch.arange(A, device=self.device), num_acc_A] = next_A
        logp_AT = logp_AV.view(A, T, V).gather(-1, emitted_AT[..., None]).squeeze(-1)
        num_acc = num_acc_A.tolist()
        self.stats.record(num_acc)
        for i, a, toks, lps in zip(
            rows, num_acc, emitted_AT.tolist(), logp_AT.tolist(), strict=True
        ):
            self.emit(i, toks[: a + 1], lps[: a + 1])
