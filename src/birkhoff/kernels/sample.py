"""The engine's per-row sampling as fused forward-only custom ops.

Legend: N rows of logits, V vocab; A rows of a step, R rows of the engine's tables, B cache rows.

Both compute, from the logits, each row's log-probabilities (tempered; greedy rows carry
temperature 1), the distribution it samples from (one-hot at the argmax for greedy rows, else
exp(logp)) and, given a uniform, its token by the inverse CDF: the eager `sampling.
target_logprobs`, `sampling_probs` and `rng.sample_inverse_cdf` (to rounding:
kernels/sample_triton.py), ~15 small launches eagerly.
- `sample_next` (`birkhoff::sample_next`) is a step's whole sampling site in one launch (a
  plain step's, a prefill's, a draft depth's; `engine.step.sample_at`): the rows' parameters
  and random keys read from the engine's per-row tables, the uniform drawn in the kernel (the
  bits of `kernels.rng`), the token written into the rows' token buffer and (token, logprob)
  returned as the step's fp64 result, where eagerly the gathers, the draw, the index write and
  the result took ~15 more launches.
- `sample_rows` (`birkhoff::sample_rows`) takes the parameters and uniforms per row: the row
  arithmetic that sample_next and `kernels.accept.verify_accept` share, with uniforms a test
  chooses (the inverse CDF's edges).
Where some row filters with top-k / top-p the engine keeps the eager sort.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import sample_triton as K
from birkhoff.kernels.mhc_mix import check_inputs, pow2

BV = 1024  # vocab entries a block, at most


@torch.library.custom_op("birkhoff::sample_rows", mutates_args=())
def sample_rows(
    logits_NV: Tensor, temperature_N: Tensor, greedy_N: Tensor, u_N: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(logp [N,V] fp32, probs [N,V] fp32, token [N] int64) of logits [N,V] (fp32 / bf16 /
    fp16), temperatures [N] (fp32), greedy flags [N] (bool) and uniforms u [N] (fp64; None:
    the greedy token for every row)."""
    check_inputs(logits_NV)
    if logits_NV.dim() != 2:
        raise ValueError(f"sample_rows: logits must be [N, V], got {tuple(logits_NV.shape)}")
    N, V = logits_NV.shape
    wanted = (("temperature", temperature_N, torch.float32), ("greedy", greedy_N, torch.bool),
              ("u", u_N, torch.float64))  # fmt: skip
    for name, t, dtype in wanted:
        if t is not None and (t.shape != (N,) or t.dtype != dtype):
            raise ValueError(f"sample_rows: {name} must be {dtype} of shape ({N},), got "
                             f"{t.dtype}{tuple(t.shape)}")  # fmt: skip
    logp = logits_NV.new_empty((N, V), dtype=torch.float32)
    probs = torch.empty_like(logp)
    token = torch.empty(N, dtype=torch.long, device=logits_NV.device)
    if N and V:
        K.sample_rows[(N,)](
            logits_NV.contiguous(), temperature_N.contiguous(), greedy_N.contiguous(),
            temperature_N if u_N is None else u_N.contiguous(), logp, probs, token, V,
            HAS_U=u_N is not None, BV=min(BV, max(16, pow2(V))), num_warps=4,
        )  # fmt: skip
    return logp, probs, token


@sample_rows.register_fake
def _(logits_NV, temperature_N, greedy_N, u_N):  # type: ignore[no-untyped-def]
    N, V = logits_NV.shape
    logp = logits_NV.new_empty((N, V), dtype=torch.float32)
    return logp, torch.empty_like(logp), logits_NV.new_empty((N,), dtype=torch.long)


def check_vector(op: str, name: str, t: Tensor, dtype: torch.dtype, size: int | None) -> None:
    """Raise ValueError unless t is a contiguous 1-D `dtype` tensor (of `size` entries)."""
    bad_size = t.dim() == 1 and size is not None and t.shape[0] != size
    if t.dtype != dtype or t.dim() != 1 or not t.is_contiguous() or bad_size:
        raise ValueError(f"{op}: {name} must be a contiguous 1-D {dtype} tensor"
                         f"{'' if size is None else f' of {size} entries'}, got "
                         f"{t.dtype}{tuple(t.shape)}")  # fmt: skip


def check_step_rows(
    op: str, A: int, rows_A: Tensor, n_A: Tensor, live_A: Tensor, temperature_R: Tensor,
    greedy_R: Tensor, key_R: Tensor,
) -> None:  # fmt: skip
    """The checks of a sampling site's per-row inputs and the engine's per-row tables."""
    for name, t in (("rows", rows_A), ("n", n_A)):
        check_vector(op, name, t, torch.long, A)
    tables = (("temperature", temperature_R, torch.float32), ("greedy", greedy_R, torch.bool),
              ("key", key_R, torch.long))  # fmt: skip
    for name, t, dtype in tables:
        check_vector(op, name, t, dtype, None)
    if live_A.shape != (A,):
        raise ValueError(f"{op}: live must have {A} entries, got {tuple(live_A.shape)}")


def check_tokens(op: str, tokens_BN: Tensor, trash: int, positions: int | None = None) -> None:
    """Raise ValueError unless tokens_BN is a row-major [B, N] int64 buffer holding the trash
    slot (and so do `positions` table rows, where given)."""
    if tokens_BN.dtype != torch.long or tokens_BN.dim() != 2 or tokens_BN.stride(1) != 1:
        raise ValueError(f"{op}: tokens must be a row-major [B, N] int64 tensor, got "
                         f"{tokens_BN.dtype}{tuple(tokens_BN.shape)}")  # fmt: skip
    N = tokens_BN.shape[1] if positions is None else min(tokens_BN.shape[1], positions)
    if not 0 <= trash < N:
        raise ValueError(f"{op}: trash slot {trash} outside the {N} positions of the tokens"
                         f"{'' if positions is None else ' and the tables'}")  # fmt: skip


@torch.library.custom_op("birkhoff::sample_next", mutates_args=("tokens_BN",))
def sample_next(
    logits_AV: Tensor, rows_A: Tensor, n_A: Tensor, live_A: Tensor, temperature_R: Tensor,
    greedy_R: Tensor, key_R: Tensor, tokens_BN: Tensor, trash: int, tags: int, tag: int,
    offset: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """([A, 2] fp64 of (token, its logprob), the tokens [A] int64, the probs [A, V] fp32 they
    were sampled from) for row a of logits [A, V], which is cache row rows[a] (int64) at
    pending position n[a] (int64) and live where live[a] != 0: sampled with that row's
    temperature_R / greedy_R (fp32 / bool) and the uniform of splitmix64(key_R[row] ^ (n * tags
    + tag)) (int64 keys), as `sample_rows` with `rng.RequestRandom.uniform`'s draw would; the
    token is also written to tokens_BN[row, n + offset] (int64; column `trash` for rows that
    are not live)."""
    check_inputs(logits_AV)
    if logits_AV.dim() != 2:
        raise ValueError(f"sample_next: logits must be [A, V], got {tuple(logits_AV.shape)}")
    A, V = logits_AV.shape
    check_step_rows("sample_next", A, rows_A, n_A, live_A, temperature_R, greedy_R, key_R)
    check_tokens("sample_next", tokens_BN, trash)
    out, token, logp, probs = _sample_next_fake(logits_AV)
    if A and V:
        K.sample_next[(A,)](
            logits_AV.contiguous(), rows_A, n_A, live_A.contiguous(), temperature_R, greedy_R,
            key_R, tokens_BN, logp, probs, out, token, V, tokens_BN.stride(0), trash, offset,
            TAGS=tags, TAG=tag, BV=min(BV, max(16, pow2(V))), num_warps=4,
        )  # fmt: skip
    return out, token, probs


def _sample_next_fake(logits_AV: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """sample_next's outputs and its logp scratch, allocated."""
    A, V = logits_AV.shape
    out = logits_AV.new_empty((A, 2), dtype=torch.float64)
    logp = logits_AV.new_empty((A, V), dtype=torch.float32)
    return out, logits_AV.new_empty((A,), dtype=torch.long), logp, torch.empty_like(logp)


@sample_next.register_fake
def _(logits_AV, *args):  # type: ignore[no-untyped-def]
    out, token, _, probs = _sample_next_fake(logits_AV)
    return out, token, probs
