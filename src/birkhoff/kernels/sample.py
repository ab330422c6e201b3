"""The engine's per-row sampling as fused forward-only custom ops.

Legend: N rows of logits, V vocab, BV vocab entries a block; A rows of a step, R rows of the
engine's tables, B cache rows.

`sample_row` computes a row's tempered log-probabilities, the distribution it samples from
(one-hot at the argmax for greedy rows) and its token by the inverse CDF: the eager
`engine.sampling.sample_tokens`, to rounding. `sample_rows` takes parameters and uniforms per
row (what tests choose); `sample_next` is a step's whole sampling site in one launch (parameters
and keys from the engine's tables, the uniform drawn in the kernel, the token written to the
rows' buffer). Left out: top-k / top-p (the engine keeps the eager sort for them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import check_inputs, pow2, tl, triton
from birkhoff.kernels.rng import uniform_bits


@triton.jit
def residual(p_row, q_row, v, V, has_q, use_p):
    """A block of the residual max(0, p - q) as fp32 (p itself where `use_p`; q = 0 where not
    `has_q`)."""
    p = tl.load(p_row + v, mask=v < V, other=0.0)
    q = tl.load(q_row + v, mask=(v < V) & has_q, other=0.0)
    return tl.where(use_p, p, tl.maximum(p - q, 0.0))


@triton.jit
def inverse_cdf(p_row, q_row, V, has_q, use_p, target, total, BV: tl.constexpr):
    """The token [1] (int64) drawn from `residual`'s weights by an fp64 scan: the first index
    whose running mass exceeds target = u * total, clamped to the last index short of the total
    (`engine.sampling.sample_inverse_cdf`)."""
    below = tl.zeros([1], dtype=tl.int64)
    short = tl.zeros([1], dtype=tl.int64)
    run = tl.zeros([1], dtype=tl.float64)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        cs = tl.cumsum(residual(p_row, q_row, v, V, has_q, use_p).to(tl.float64), axis=0)
        c = run + cs
        below += tl.sum(((c <= target) & (v < V)).to(tl.int64), axis=0)
        short += tl.sum(((c < total) & (v < V)).to(tl.int64), axis=0)
        run += tl.max(cs, axis=0)
    return tl.minimum(below, short)


@triton.jit
def sample_row(logits, logp_row, probs_row, t, greedy, u, V, HAS_U: tl.constexpr, BV: tl.constexpr):
    """The token [1] (int64) of one row; stores its logp and probs. `u` is read only where
    HAS_U and the row is not greedy."""
    m = tl.full([1], float("-inf"), tl.float32)
    s = tl.zeros([1], dtype=tl.float32)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        z = tl.load(logits + v, mask=v < V, other=float("-inf")).to(tl.float32) / t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    log_s = tl.log(s)
    best = tl.full([1], float("-inf"), tl.float32)
    best_i = tl.zeros([1], dtype=tl.int64)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        z = tl.load(logits + v, mask=v < V, other=float("-inf")).to(tl.float32) / t
        lp = (z - m) - log_s
        tl.store(logp_row + v, lp, mask=v < V)
        block_best = tl.max(lp, axis=0)
        first = tl.min(tl.where(lp == block_best, v, V), axis=0).to(tl.int64)
        best_i = tl.where(block_best > best, first, best_i)
        best = tl.maximum(best, block_best)
    total = tl.zeros([1], dtype=tl.float64)
    for v0 in range(0, V, BV):
        v = v0 + tl.arange(0, BV)
        lp = tl.load(logp_row + v, mask=v < V, other=float("-inf"))
        p = tl.where(greedy, tl.where(v == best_i, 1.0, 0.0), tl.exp(lp))
        tl.store(probs_row + v, p, mask=v < V)
        total += tl.max(tl.cumsum(p.to(tl.float64), axis=0), axis=0)
    token = best_i
    if HAS_U:  # noqa: SIM102 (a compile-time branch around a runtime one)
        if not greedy:
            token = inverse_cdf(probs_row, probs_row, V, False, True, u * total, total, BV)
    return token


@triton.jit
def sample_rows_kernel(
    logits_ptr,
    temp_ptr,
    greedy_ptr,
    u_ptr,
    logp_ptr,
    probs_ptr,
    token_ptr,
    V,
    HAS_U: tl.constexpr,
    BV: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    u = tl.load(u_ptr + row) if HAS_U else 0.0
    token = sample_row(
        logits_ptr + row * V, logp_ptr + row * V, probs_ptr + row * V, t, greedy, u, V, HAS_U, BV
    )
    tl.store(token_ptr + row + tl.arange(0, 1), token)


@triton.jit
def sample_next_kernel(
    logits_ptr,
    rows_ptr,
    n_ptr,
    live_ptr,
    temp_ptr,
    greedy_ptr,
    key_ptr,
    tokens_ptr,
    logp_ptr,
    probs_ptr,
    out_ptr,
    token_ptr,
    V,
    stride_tokens,
    trash,
    offset,
    TAGS: tl.constexpr,
    TAG: tl.constexpr,
    BV: tl.constexpr,
):
    a = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + a)
    n = tl.load(n_ptr + a).to(tl.int64)
    live = tl.load(live_ptr + a) != 0
    t = tl.load(temp_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    u = uniform_bits(tl.load(key_ptr + row), n * TAGS + TAG)
    token = sample_row(
        logits_ptr + a * V, logp_ptr + a * V, probs_ptr + a * V, t, greedy, u, V, True, BV
    )
    tl.debug_barrier()  # the token's logp was stored by another thread of the program
    logp = tl.load(logp_ptr + a * V + token)
    slot = tl.where(live, n + offset, trash)
    one = tl.arange(0, 1)
    tl.store(tokens_ptr + row * stride_tokens + slot + one, token)
    tl.store(token_ptr + a + one, token)
    tl.store(out_ptr + 2 * a + one, token.to(tl.float64))
    tl.store(out_ptr + 2 * a + 1 + one, logp.to(tl.float64))


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
    wanted = (
        ("temperature", temperature_N, torch.float32),
        ("greedy", greedy_N, torch.bool),
        ("u", u_N, torch.float64),
    )
    for name, t, dtype in wanted:
        if t is not None:
            check_tensor("sample_rows", name, t, dtype, (N,), contiguous=False)
    logp = logits_NV.new_empty((N, V), dtype=torch.float32)
    probs = torch.empty_like(logp)
    token = torch.empty(N, dtype=torch.long, device=logits_NV.device)
    if N and V:
        sample_rows_kernel[(N,)](
            logits_NV.contiguous(),
            temperature_N.contiguous(),
            greedy_N.contiguous(),
            temperature_N if u_N is None else u_N.contiguous(),
            logp,
            probs,
            token,
            V,
            HAS_U=u_N is not None,
            BV=min(BV, max(16, pow2(V))),
            num_warps=4,
        )
    return logp, probs, token


@sample_rows.register_fake
def _(logits_NV, temperature_N, greedy_N, u_N):  # type: ignore[no-untyped-def]
    N, V = logits_NV.shape
    logp = logits_NV.new_empty((N, V), dtype=torch.float32)
    return logp, torch.empty_like(logp), logits_NV.new_empty((N,), dtype=torch.long)


def check_tensor(
    op: str,
    name: str,
    t: Tensor,
    dtype: torch.dtype,
    shape: tuple[int | None, ...],
    *,
    contiguous: bool = True,
) -> None:
    """Raise ValueError unless t is a `dtype` tensor of `shape` (None: any size there), and
    contiguous where asked."""
    sizes_ok = all(want is None or n == want for n, want in zip(t.shape, shape, strict=False))
    shape_ok = t.dim() == len(shape) and sizes_ok
    if t.dtype != dtype or not shape_ok or (contiguous and not t.is_contiguous()):
        wanted = ", ".join("*" if n is None else str(n) for n in shape)
        layout = "contiguous " if contiguous else ""
        raise ValueError(
            f"{op}: {name} must be a {layout}{dtype} tensor of shape [{wanted}], got "
            f"{t.dtype}{tuple(t.shape)}"
        )


def check_row_major(op: str, name: str, t: Tensor, layout: str) -> None:
    """Raise ValueError unless t is a 2-D int64 tensor whose rows are contiguous."""
    if t.dtype != torch.long or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(
            f"{op}: {name} must be a row-major {layout} int64 tensor, got {t.dtype}{tuple(t.shape)}"
        )


def check_step_rows(
    op: str,
    A: int,
    rows_A: Tensor,
    n_A: Tensor,
    live_A: Tensor,
    temperature_R: Tensor,
    greedy_R: Tensor,
    key_R: Tensor,
) -> None:
    """The checks of a sampling site's per-row inputs and the engine's per-row tables."""
    for name, t in (("rows", rows_A), ("n", n_A)):
        check_tensor(op, name, t, torch.long, (A,))
    tables = (
        ("temperature", temperature_R, torch.float32),
        ("greedy", greedy_R, torch.bool),
        ("key", key_R, torch.long),
    )
    for name, t, dtype in tables:
        check_tensor(op, name, t, dtype, (None,))
    if live_A.shape != (A,):
        raise ValueError(f"{op}: live must have {A} entries, got {tuple(live_A.shape)}")


def check_tokens(op: str, tokens_BN: Tensor, trash: int, positions: int | None = None) -> None:
    """Raise ValueError unless tokens_BN is a row-major [B, N] int64 buffer holding the trash
    slot (and so do `positions` table rows, where given)."""
    check_row_major(op, "tokens", tokens_BN, "[B, N]")
    N = tokens_BN.shape[1] if positions is None else min(tokens_BN.shape[1], positions)
    if not 0 <= trash < N:
        raise ValueError(
            f"{op}: trash slot {trash} outside the {N} positions of the tokens"
            f"{'' if positions is None else ' and the tables'}"
        )


@torch.library.custom_op("birkhoff::sample_next", mutates_args=("tokens_BN",))
def sample_next(
    logits_AV: Tensor,
    rows_A: Tensor,
    n_A: Tensor,
    live_A: Tensor,
    temperature_R: Tensor,
    greedy_R: Tensor,
    key_R: Tensor,
    tokens_BN: Tensor,
    trash: int,
    tags: int,
    tag: int,
    offset: int,
) -> tuple[Tensor, Tensor, Tensor]:
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
        sample_next_kernel[(A,)](
            logits_AV.contiguous(),
            rows_A,
            n_A,
            live_A.contiguous(),
            temperature_R,
            greedy_R,
            key_R,
            tokens_BN,
            logp,
            probs,
            out,
            token,
            V,
            tokens_BN.stride(0),
            trash,
            offset,
            TAGS=tags,
            TAG=tag,
            BV=min(BV, max(16, pow2(V))),
            num_warps=4,
        )
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
