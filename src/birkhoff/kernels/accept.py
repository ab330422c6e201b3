"""A speculative step's verify tail as one fused forward-only custom op
(`birkhoff::verify_accept`).

Legend: A rows of the step, J drafts a row, T = J + 1 verified positions, V vocab; R rows of the
engine's tables, B cache rows.

After the verify pass, `engine.step.verify` eagerly runs ~55 small launches: the rows'
sampling parameters gathered and repeated, the main model's distributions
(`sampling.sample_tokens`), the J + 1 uniforms, `speculative.accept_drafts` (gathers, a
cumulative product, the residual and its inverse-CDF draw), the next token's write, the
result's gathers and casts, and the next step's n and draft starts. At decode sizes each costs
its launch, not its bytes. `verify_accept` computes the same in one launch
(kernels/accept_triton.py): the distributions of `sample.sample_rows`' row arithmetic and the
acceptance decisions bit for bit, the residual's draw to the rounding of its fp64 scan. Where
some row filters with top-k / top-p the eager path runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import accept_triton as K
from birkhoff.kernels.mhc_mix import check_inputs, pow2
from birkhoff.kernels.sample import BV, check_step_rows, check_tokens, check_vector


def _check(name: str, t: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.shape != shape:
        raise ValueError(f"verify_accept: {name} must be a contiguous {dtype} tensor of shape "
                         f"{shape}, got {t.dtype}{tuple(t.shape)}")  # fmt: skip


@torch.library.custom_op("birkhoff::verify_accept", mutates_args=("tokens_BN", "n_B", "starts_JB"))
def verify_accept(
    logits_ATV: Tensor, q_AJV: Tensor, drafts_AJ: Tensor, rows_A: Tensor, n_A: Tensor,
    live_A: Tensor, temperature_R: Tensor, greedy_R: Tensor, key_R: Tensor, tokens_BN: Tensor,
    n_B: Tensor, starts_JB: Tensor, trash: int, tags: int, sample_tag: int, accept_tag: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(accepted drafts a [A] int64, [A, 1 + 2T] fp64: a, the T emitted tokens, their logprobs)
    for the main model's logits [A, T, V] at positions n..n+J of cache rows `rows_A`, the J
    drafts [A, J] (int64) and the distributions q [A, J, V] (fp32) they were drawn from: exact
    rejection sampling as `speculative.accept_drafts`, with row r's temperature_R / greedy_R and
    the uniforms splitmix64(key_R[r] ^ (n * tags + tag)) of tags accept_tag + j and sample_tag,
    as `rng.RequestRandom.uniform` draws them. The next token is also written to
    tokens_BN[row, n + 1 + a] (column `trash` for rows whose live entry is 0), and a live row's
    next step reads n_B[row] = n + 1 + a and starts_JB[k - 1, row] = max(0, n - k + 1) for
    k = 1..J (int64; the first position draft depth k recomputes)."""
    check_inputs(logits_ATV)
    if logits_ATV.dim() != 3 or drafts_AJ.dim() != 2:
        raise ValueError(f"verify_accept: logits must be [A, T, V] and drafts [A, J], got "
                         f"{tuple(logits_ATV.shape)} / {tuple(drafts_AJ.shape)}")  # fmt: skip
    (A, T, V), J = logits_ATV.shape, drafts_AJ.shape[1]
    if T != J + 1 or J < 1:
        raise ValueError(f"verify_accept: {T} verified positions for {J} drafts (need J + 1)")
    _check("q", q_AJV, torch.float32, (A, J, V))
    _check("drafts", drafts_AJ, torch.long, (A, J))
    check_step_rows("verify_accept", A, rows_A, n_A, live_A, temperature_R, greedy_R, key_R)
    check_tokens("verify_accept", tokens_BN, trash)
    check_vector("verify_accept", "n_B", n_B, torch.long, None)
    if starts_JB.dtype != torch.long or starts_JB.dim() != 2 or starts_JB.stride(1) != 1:
        raise ValueError(f"verify_accept: starts must be a row-major [J, B] int64 tensor, got "
                         f"{starts_JB.dtype}{tuple(starts_JB.shape)}")  # fmt: skip
    if starts_JB.shape[0] < J or starts_JB.shape[1] != n_B.shape[0]:
        raise ValueError(f"verify_accept: starts {tuple(starts_JB.shape)} for {J} drafts and "
                         f"{n_B.shape[0]} rows")  # fmt: skip
    num, out = _fake(logits_ATV, drafts_AJ)
    if A and V:
        scratch = logits_ATV.new_empty((2, A, T, V), dtype=torch.float32)  # logp, p
        K.verify_accept[(A,)](
            logits_ATV.contiguous(), q_AJV, drafts_AJ, rows_A, n_A, live_A.contiguous(),
            temperature_R, greedy_R, key_R, tokens_BN, n_B, starts_JB, scratch[0], scratch[1],
            out, num, V, J, tokens_BN.stride(0), starts_JB.stride(0), trash, TAGS=tags,
            SAMPLE=sample_tag, ACCEPT=accept_tag,
            BV=min(BV, max(16, pow2(V))), num_warps=4,
        )  # fmt: skip
    return num, out


def _fake(logits_ATV: Tensor, drafts_AJ: Tensor) -> tuple[Tensor, Tensor]:
    A, T = logits_ATV.shape[:2]
    num = drafts_AJ.new_empty((A,), dtype=torch.long)
    return num, logits_ATV.new_empty((A, 1 + 2 * T), dtype=torch.float64)


@verify_accept.register_fake
def _(logits_ATV, q_AJV, drafts_AJ, *args):  # type: ignore[no-untyped-def]
    return _fake(logits_ATV, drafts_AJ)
