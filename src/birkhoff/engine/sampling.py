"""Sampling in one place: parameters, the per-row distribution, the inverse-CDF draw, and a
step's sampling site (`sample_site`: the fused `kernels.sample.sample_next`, or these eager
functions, which are its reference).

Legend: A rows of logits (active rows, or active rows x chunk tokens flattened), V vocab,
B cache rows, N cache positions.

`target_logprobs` gives the distribution a token is sampled from: for temperature > 0, logits /
temperature, then top-k, then top-p, then softmax over what is kept (a sampled token's logprob
is under exactly this distribution); for greedy rows the one-hot at the argmax, which reduces
exact rejection sampling to argmax agreement, with the logprob under the untempered softmax (what
a trainer computes). Everything runs in >= fp32 without an fp32 copy of the logits. Details:
docs/engine.md.
Left out: repetition/presence penalties, min-p, beam search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from birkhoff.config import check
from birkhoff.engine.rng import TAGS, RequestRandom
from birkhoff.engine.transfer import to_device
from birkhoff.kernels.sample import sample_next


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one sequence. `max_new_tokens` may be given positionally."""

    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()  # generation stops after emitting one of these
    stop: tuple[str, ...] = ()  # ... or once its text holds one of these (engine/stop.py)
    seed: int | None = None  # None: nondeterministic
    num_speculative_tokens: int = 0  # MTP drafts per verify step; 0 = plain decoding

    def __post_init__(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        n = self.max_new_tokens
        check(is_int(n) and n >= 1, "max_new_tokens", n, "must be an int >= 1")
        t = self.temperature
        ok_t = isinstance(t, int | float) and math.isfinite(t) and t >= 0
        check(ok_t, "temperature", t, "must be a finite number >= 0")
        p = self.top_p
        check(isinstance(p, int | float) and 0 < p <= 1, "top_p", p, "must be in (0, 1]")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k, "must be an int >= 0")
        stops = tuple(self.stop_token_ids)
        ok_stops = all(is_int(s) and s >= 0 for s in stops)
        check(ok_stops, "stop_token_ids", self.stop_token_ids, "must be ints >= 0")
        object.__setattr__(self, "stop_token_ids", stops)
        texts = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        ok_texts = all(isinstance(s, str) and s for s in texts)
        check(ok_texts, "stop", self.stop, "must be non-empty strings")
        object.__setattr__(self, "stop", texts)
        check(self.seed is None or is_int(self.seed), "seed", self.seed, "must be None or an int")
        k = self.num_speculative_tokens
        check(is_int(k) and k >= 0, "num_speculative_tokens", k, "must be an int >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def is_filtered(p: SamplingParams) -> bool:
    """Whether sampling with `p` filters the distribution (top-k or top-p; never for greedy)."""
    return not p.greedy and (p.top_k > 0 or p.top_p < 1)


class RowSampling(NamedTuple):
    """Sampling parameters as tensors, one entry per row of logits (rows may differ)."""

    temperature_A: Tensor
    top_k_A: Tensor
    top_p_A: Tensor
    greedy_A: Tensor
    filtered: bool  # some sampled row uses top-k or top-p (else the sort is skipped)

    @classmethod
    def build(cls, params: list[SamplingParams], device: torch.device) -> RowSampling:
        table = SamplingTable(len(params), device)
        table.assign(list(range(len(params))), params)
        rows_A = torch.arange(len(params), device=device)
        return table.select(rows_A, filtered=any(map(is_filtered, params)))

    def select(self, rows_A: Tensor, repeat: int = 1) -> RowSampling:
        """The params of `rows_A`, each repeated `repeat` times (for [A, T] flattened logits)."""
        if repeat > 1:
            rows_A = rows_A.repeat_interleave(repeat)
        t, k, p, g = (x[rows_A] for x in self[:4])
        return RowSampling(t, k, p, g, self.filtered)


class SamplingTable:
    """The sampling parameters of every cache row, in tensors allocated once (graph-safe)."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.params = RowSampling(
            torch.ones(num_rows, device=device),
            torch.zeros(num_rows, dtype=torch.long, device=device),
            torch.ones(num_rows, device=device),
            torch.ones(num_rows, dtype=torch.bool, device=device),
            filtered=False,
        )
        self.device = device

    def assign(self, rows: list[int], params: list[SamplingParams]) -> None:
        """Rows `rows` now sample with `params` (one queued copy, no host sync)."""
        values = [
            [1.0, 0, 1.0, 1] if p.greedy else [p.temperature, p.top_k, p.top_p, 0] for p in params
        ]
        values_4A = to_device(values, self.device, torch.float64).T
        rows_A = to_device(rows, self.device)
        for dst, src in zip(self.params[:4], values_4A, strict=True):
            dst[rows_A] = src.to(dst.dtype)

    def select(self, rows_A: Tensor, repeat: int = 1, *, filtered: bool) -> RowSampling:
        """The params of `rows_A` (each `repeat` times); `filtered`: whether any of them filters."""
        return self.params._replace(filtered=filtered).select(rows_A, repeat)


def filter_top_k_top_p(z_AV: Tensor, top_k_A: Tensor, top_p_A: Tensor) -> Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    sorted_AV, order_AV = z_AV.sort(dim=-1, descending=True)
    rank_V = torch.arange(z_AV.shape[-1], device=z_AV.device)
    drop_AV = (top_k_A[:, None] > 0) & (rank_V[None, :] >= top_k_A[:, None])
    sorted_AV = sorted_AV.masked_fill(drop_AV, -math.inf)
    probs_AV = sorted_AV.softmax(dim=-1)
    mass_before_AV = probs_AV.cumsum(dim=-1) - probs_AV  # first token: 0 < top_p, always kept
    drop_AV = drop_AV | ((top_p_A[:, None] < 1) & (mass_before_AV >= top_p_A[:, None]))
    sorted_AV = sorted_AV.masked_fill(drop_AV, -math.inf)
    return torch.full_like(z_AV, -math.inf).scatter(-1, order_AV, sorted_AV)


def target_logprobs(logits_AV: Tensor, rs: RowSampling) -> Tensor:
    """Log-probabilities of the distribution each row samples from (see the module docstring)."""
    dtype = torch.promote_types(logits_AV.dtype, torch.float32)
    z_AV = logits_AV / rs.temperature_A.to(dtype)[:, None]  # [A,V] in `dtype`, read from logits
    if rs.filtered:
        z_AV = filter_top_k_top_p(z_AV, rs.top_k_A, rs.top_p_A)
    return F.log_softmax(z_AV, dim=-1)


def sampling_probs(logp_AV: Tensor, greedy_A: Tensor) -> Tensor:
    """exp(logp), with greedy rows replaced by the one-hot distribution at their argmax."""
    greedy_A1 = greedy_A[:, None]
    top_A1 = logp_AV.argmax(dim=-1, keepdim=True)
    probs_AV = logp_AV.exp().masked_fill_(greedy_A1, 0.0)
    at_top_A1 = torch.where(greedy_A1, 1.0, probs_AV.gather(-1, top_A1))
    return probs_AV.scatter_(-1, top_A1, at_top_A1)


def sample_logits(logits_AV: Tensor, rs: RowSampling) -> tuple[Tensor, Tensor]:
    """(log-probs of each row's target distribution, the probs its token is sampled from)."""
    logp_AV = target_logprobs(logits_AV, rs)
    return logp_AV, sampling_probs(logp_AV, rs.greedy_A)


def sample_inverse_cdf(probs_AV: Tensor, u_A: Tensor) -> Tensor:
    """The first index whose cumulative mass exceeds u * total: exact sampling from probs.

    u * total can round up to total; the clamp to the first index reaching the total (the last
    token with mass) keeps zero-mass tokens out in that case too.
    """
    cdf_AV = probs_AV.double().cumsum(dim=-1)
    total_A1 = cdf_AV[:, -1:].contiguous()
    index_A1 = torch.searchsorted(cdf_AV, u_A[:, None] * total_A1, right=True)
    last_A1 = torch.searchsorted(cdf_AV, total_A1, right=False)
    return torch.minimum(index_A1, last_A1).squeeze(-1)


def sample_tokens(
    logits_AV: Tensor, rs: RowSampling, u_A: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(log-probs, the probs a token is sampled from, the token drawn with uniforms `u_A` by the
    inverse CDF, or None without them): the eager reference of `kernels.sample.sample_rows`."""
    logp_AV, probs_AV = sample_logits(logits_AV, rs)
    return logp_AV, probs_AV, None if u_A is None else sample_inverse_cdf(probs_AV, u_A)


class SiteRows(NamedTuple):
    """The rows a sampling site draws for and the engine's per-row state it reads and writes."""

    rows_A: Tensor  # cache rows
    n_A: Tensor  # their pending positions
    live_A: Tensor  # rows that hold a request (the others write the trash slot)
    table: SamplingTable
    rng: RequestRandom
    tokens_BN: Tensor
    trash: int


def sample_site(
    logits_AV: Tensor, site: SiteRows, tag: int, offset: int, *, fused: bool, filtered: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """A sampling site of rows at pending positions n (draw tag `tag`): ([A, 2] fp64 of (token,
    its logprob), the tokens [A], the probs [A, V] they were drawn from); each token is written
    to tokens_BN at n + offset (the trash slot where not live). `fused` (no row filtering): one
    launch (`kernels.sample.sample_next`); else the eager `sample_tokens`, which also serves
    top-k / top-p (`filtered`: some row filters)."""
    rows_A, n_A, live_A, table, rng, tokens_BN, trash = site
    if fused:
        params = table.params
        tables = (params.temperature_A, params.greedy_A, rng.keys_R)
        return sample_next(
            logits_AV, rows_A, n_A.long(), live_A, *tables, tokens_BN, trash, TAGS, tag, offset
        )
    rs = table.select(rows_A, filtered=filtered)
    u_A = rng.uniform(rows_A, n_A, tag)
    logp_AV, probs_AV, token_A = sample_tokens(logits_AV, rs, u_A)
    assert token_A is not None
    tokens_BN[rows_A, torch.where(live_A, n_A + offset, trash)] = token_A
    logp_A = logp_AV.gather(-1, token_A[:, None]).squeeze(-1)
    return torch.stack((token_A.double(), logp_A.double()), dim=1), token_A, probs_AV
