"""One generate call: prefill, then plain or speculative decode steps until every request is done.

Legend: R requests, B cache rows, N cache positions, A active rows, T tokens of a chunk,
J drafts per step, S streams, D model dim, V vocab.

Requests take free cache rows in call order and finished rows are refilled before every step
(scheduler.py); randomness is per request (rng.py), so a request's tokens do not depend on its
batch. Steps (step.py) run eagerly or from CUDA graphs (graphs.py), one step ahead of the host.
A request ends at a stop token, a stop string (stop.py) or its length; rolling back is implicit
(cache slots past a row's valid length are masked and later overwritten). The per-row
bookkeeping (`n`, the drafter's `valid`) and the speculative step are described in docs/engine.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.graphs import Steps
from birkhoff.engine.kv_cache import DrafterState, KVCache
from birkhoff.engine.layout import Weights
from birkhoff.engine.rng import RequestRandom
from birkhoff.engine.rows import RowState
from birkhoff.engine.sampling import SamplingParams, is_filtered
from birkhoff.engine.scheduler import Scheduler
from birkhoff.engine.speculative import SpecStats
from birkhoff.engine.step import (
    StepContext,
    catch_up_step,
    plain_step,
    prefill_step,
    speculative_step,
)
from birkhoff.engine.stop import Detokenize, StopText
from birkhoff.engine.transfer import HostCopy, to_device, to_host


@dataclass(frozen=True, slots=True)
class Completion:
    tokens: list[int]  # generated tokens, prompt excluded (a stop token is included)
    logprobs: list[float]  # of each token under the distribution it was sampled from
    weight_version: int  # the engine weights that produced it
    finish_reason: str  # "stop" (stop token or string) | "length" (max_new_tokens, max_seq_len)
    text: str | None = None  # with a detokenizer: the text, ending with its stop string if any


PREFILL_GRAPH_TOKENS = 8192  # batch bucket x length bucket of the largest graphed prefill


class QueuedStep(NamedTuple):
    """A queued step: its rows, their requests, and its results on their way to the host."""

    rows: list[int]
    requests: list[int]
    out: HostCopy  # plain: (next token, its logprob) per row; speculative: step.verify's rows


class Generation:
    """The state of one generate call: requests over cache rows, steps until all are done."""

    def __init__(
        self,
        *,
        cfg: ModelConfig,
        weights: Weights,
        steps: Steps,
        cache: KVCache,
        drafter: DrafterState | None,
        rows: RowState,
        rope: tuple[Tensor, Tensor],
        prompts: list[list[int]],
        params: list[SamplingParams],
        max_seq_len: int,
        seed: int,
        kernels: str,
        detokenize: Detokenize | None = None,
    ) -> None:
        self.cfg, self.steps, self.w, self.cache = cfg, steps, weights, cache
        self.drafter, self.rope, self.device = drafter, rope, cache.k.device
        self.prompts, self.params, self.max_seq_len, self.seed = prompts, params, max_seq_len, seed
        B, R = cache.k.shape[1], len(prompts)  # cache rows, requests
        self.scheduler = Scheduler(R, B)
        self.rows, self.rng, self.tokens_BN = rows, rows.rng, rows.tokens_BN
        self.row_params = [params[0]] * B  # the params of the request in each row
        self.n = [0] * B  # per row: position of the pending token
        self.num_drafts = params[0].num_speculative_tokens
        self.valid = [[0] * B for _ in range(self.num_drafts)]
        self.out_tokens: list[list[int]] = [[] for _ in range(R)]
        self.out_logprobs: list[list[float]] = [[] for _ in range(R)]
        self.finish: list[str | None] = [None] * R
        self.texts = [None if detokenize is None else StopText(p.stop, detokenize) for p in params]
        self.stats = SpecStats(self.num_drafts)
        self.ctx = StepContext(
            weights, cfg, kernels, cache, drafter, rows, rope, self.num_drafts, False
        )
        self.any_filtered = any(map(is_filtered, params))  # False: every step runs with ctx

    def run(self) -> list[Completion]:
        if self.num_drafts:
            ahead = self.steps.static_shapes  # eager draft lengths come from the host's n
            self.run_ahead(
                lambda pending: self.scheduler.active_rows,
                lambda pending: ahead and self.can_run_ahead(pending),
                self.queue_speculative_step,
                self.collect_speculative,
            )
        else:
            self.run_ahead(
                self.plain_rows,
                lambda pending: True,
                lambda rows, pending: self.queue_plain_step(rows),
                self.collect,
            )
        return [
            Completion(toks, lps, -1, reason or "length", text.final_text() if text else None)
            for toks, lps, reason, text in zip(
                self.out_tokens, self.out_logprobs, self.finish, self.texts, strict=True
            )
        ]

    def run_ahead(
        self,
        rows_of: Callable[[QueuedStep | None], list[int]],
        ahead: Callable[[QueuedStep], bool],
        queue: Callable[[list[int], QueuedStep | None], QueuedStep],
        collect: Callable[[QueuedStep], None],
    ) -> None:
        """Decode one step ahead of the host: step t+1 is queued on the device before step t's
        result is read (collect waits for step t only), so the device does not wait for the
        host's bookkeeping; a row that step t finished has run step t+1 in vain (its result is
        dropped). Where `ahead(pending)` says no, step t is read before step t+1 is queued.
        Plain steps always run ahead (their positions are known: n grows by one; rows that
        reach their length are not queued again). Speculative steps do with graphs: a step
        reads each row's n and draft starts from the device, where the step before advanced
        them, while every row is far enough from max_seq_len (`can_run_ahead`)."""
        pending: QueuedStep | None = None
        while not self.scheduler.done:
            self.admit()  # refill rows freed by the last collected step
            rows = rows_of(pending)
            if pending is not None and not (rows and ahead(pending)):
                collect(pending)
                pending = None
                continue
            queued = queue(rows, pending) if rows else None
            if pending is not None:
                collect(pending)
            pending = queued

    def plain_rows(self, pending: QueuedStep | None) -> list[int]:
        """The active rows a plain step runs: not those done by length once `pending` is read."""
        request_of = self.scheduler.request_of
        in_flight = dict(zip(pending.rows, pending.requests, strict=True)) if pending else {}
        return [
            i
            for i in self.scheduler.active_rows
            if not self.reaches_length(i, in_flight.get(i, -1) == request_of[i])
        ]

    def reaches_length(self, i: int, token_in_flight: bool) -> bool:
        """Whether row i's request is done by length once its in-flight token is emitted."""
        r = self.scheduler.request_of[i]
        emitted = len(self.out_tokens[r]) + token_in_flight
        p = self.params[r]
        return emitted >= p.max_new_tokens or len(self.prompts[r]) + emitted >= self.max_seq_len

    def n_of(self, rows: list[int]) -> Tensor:
        return to_device([self.n[i] for i in rows], self.device)

    def context(self, rows: list[int]) -> StepContext:
        """The step context for `rows` (whether some of them sample with top-k / top-p)."""
        if not self.any_filtered:
            return self.ctx
        filtered = any(is_filtered(self.row_params[i]) for i in rows)
        return self.ctx if filtered == self.ctx.filtered else replace(self.ctx, filtered=filtered)

    def admit(self) -> None:
        """Give free rows to waiting requests and prefill them (`prefill_step`: a CUDA graph of
        the rows' batch bucket and prompt-length bucket with graphs, up to PREFILL_GRAPH_TOKENS
        positions in all, else eagerly over the prompts)."""
        admitted = self.scheduler.admit()
        if not admitted:
            return
        rows = [row for row, _ in admitted]
        for row, r in admitted:
            self.n[row] = len(self.prompts[r]) - 1  # prefill runs the last prompt token too
            self.row_params[row] = self.params[r]
            for valid in self.valid:
                valid[row] = 0
        self.rng.assign(rows, [RequestRandom.request_key(self.seed, r) for _, r in admitted])
        self.rows.sampling.assign(rows, [self.row_params[i] for i in rows])
        lengths = [self.n[i] + 1 for i in rows]
        tokens_AT = torch.zeros((len(rows), max(lengths)), dtype=torch.long)
        for a, (_, r) in enumerate(admitted):
            tokens_AT[a, : len(self.prompts[r])] = torch.tensor(self.prompts[r])
        rows_A = to_device(rows, self.device)
        self.tokens_BN[rows_A, : tokens_AT.shape[1]] = to_device(tokens_AT, self.device)
        out_A2 = self.steps.run(
            prefill_step,
            self.context(rows),
            rows,
            [lengths, [1] * len(rows)],
            max(lengths),
            max_graph_tokens=PREFILL_GRAPH_TOKENS,
        )
        for i, (tok, lp) in zip(rows, out_A2.tolist(), strict=True):
            self.emit(i, [int(tok)], [lp])
        if self.drafter is not None:  # speculative (num_drafts > 0)
            self.catch_up_drafter(rows)
            # speculative steps read n and the draft starts from the device
            self.rows.n_B[rows_A] = self.n_of(rows)
            starts = [[valid[i] for i in rows] for valid in self.valid]
            self.drafter.valid_JB[: self.num_drafts, rows_A] = to_device(starts, self.device)

    def catch_up_drafter(self, rows: list[int]) -> None:
        """Run depth k over positions 0..n-k-1 of newly admitted rows (`catch_up_step`, graphed
        as prefill is), so a step recomputes at most J + k."""
        assert self.drafter is not None
        for k in range(1, self.num_drafts + 1):
            for i in rows:
                self.valid[k - 1][i] = max(0, self.n[i] - k)
        longest = max(self.n[i] - 1 for i in rows)  # depth 1's positions
        if longest >= 1:
            state = [[self.n[i] for i in rows], [1] * len(rows)]
            self.steps.run(
                catch_up_step,
                self.context(rows),
                rows,
                state,
                longest,
                max_graph_tokens=PREFILL_GRAPH_TOKENS,
            )

    def queue_plain_step(self, rows: list[int]) -> QueuedStep:
        """Queue one plain step of `rows` (no host sync); their positions advance by one."""
        state = [[self.n[i] for i in rows], [1] * len(rows)]
        limit = max(self.n[i] for i in rows) + 1
        out_A2 = self.steps.run(plain_step, self.context(rows), rows, state, limit)
        for i in rows:
            self.n[i] += 1
        requests = [self.scheduler.request_of[i] for i in rows]
        return QueuedStep(rows, requests, to_host(out_A2))

    def collect(self, step: QueuedStep) -> None:
        """Emit a queued step's tokens to the requests that still own the rows (waits for that
        step's copy only, while the step queued after it runs)."""
        request_of, finish = self.scheduler.request_of, self.finish
        for i, r, (tok, lp) in zip(step.rows, step.requests, step.out.tolist(), strict=True):
            if request_of.get(i) == r and finish[r] is None:
                self.append(i, r, int(tok), lp)

    def emit(self, i: int, tokens: list[int], logprobs: list[float], advance: bool = True) -> None:
        """Append tokens to row i's request until a stop token, max_new_tokens or max_seq_len;
        a finished request frees its row. `advance`: move n past the tokens (queued plain steps
        moved it already)."""
        r = self.scheduler.request_of[i]
        for tok, lp in zip(tokens, logprobs, strict=True):
            if self.append(i, r, tok, lp):
                return
        if advance:
            self.n[i] += len(tokens)

    def append(self, i: int, r: int, tok: int, lp: float) -> bool:
        """Append one token to request r (in row i); whether that finished it (its row freed):
        a stop token, a stop string completed by this token, or the length limits."""
        p, out, text = self.params[r], self.out_tokens[r], self.texts[r]
        out.append(tok)
        self.out_logprobs[r].append(lp)
        if tok in p.stop_token_ids or (text is not None and text.push(tok)):
            self.finish[r] = "stop"
        elif len(out) >= p.max_new_tokens or len(self.prompts[r]) + len(out) >= self.max_seq_len:
            self.finish[r] = "length"
        else:
            return False
        self.scheduler.release(i)
        return True

    def can_run_ahead(self, pending: QueuedStep) -> bool:
        """Whether a step queued behind `pending` stays inside the cache for every row of it,
        even one that `pending` finishes (n grows by at most J + 1 a step)."""
        J = self.num_drafts
        return all(self.n[i] + 2 * (J + 1) < self.max_seq_len + J for i in pending.rows)

    def queue_speculative_step(self, rows: list[int], pending: QueuedStep | None) -> QueuedStep:
        """Queue draft, verify and accept for `rows` (no host sync). A row of `pending` (still
        in flight) starts from the n and draft starts `pending` leaves on the device: at most
        J + 1 positions past the host's n."""
        J, in_flight = self.num_drafts, set(pending.rows) if pending is not None else set()
        limit = max(self.n[i] + J + 1 + (J + 1) * (i in in_flight) for i in rows)
        ctx = self.context(rows)
        if not self.steps.static_shapes:  # each depth only as long as its longest row
            assert not in_flight, "eager speculative steps are read before the next is queued"
            lengths = [max(self.n[i] - valid[i] for i in rows) for valid in self.valid]
            assert all(m <= J + k for k, m in enumerate(lengths, start=1)), "drafter behind"
            ctx = replace(ctx, draft_lengths=tuple(lengths))
        out = self.steps.run(speculative_step, ctx, rows, [[1] * len(rows)], limit)
        requests = [self.scheduler.request_of[i] for i in rows]
        return QueuedStep(rows, requests, to_host(out))

    def collect_speculative(self, step: QueuedStep) -> None:
        """Record and emit a queued speculative step's result for the requests that still own
        its rows; the host's n and draft starts follow the device's."""
        J = self.num_drafts
        mine = [
            (i, row)
            for i, r, row in zip(step.rows, step.requests, step.out.tolist(), strict=True)
            if self.scheduler.request_of.get(i) == r and self.finish[r] is None
        ]
        self.stats.record([int(row[0]) for _, row in mine])
        for i, row in mine:
            for k, valid in enumerate(self.valid, start=1):
                valid[i] = max(0, self.n[i] - k + 1)  # positions <= n-k used accepted tokens
            a = int(row[0])
            self.emit(i, [int(t) for t in row[1 : a + 2]], row[J + 2 : J + 3 + a])
