"""The engine's per-row sampling as one fused forward-only custom op (`birkhoff::sample_rows`).

Legend: N rows of logits, V vocab.

`engine.sampling.sample_tokens` calls it where fused kernels apply and no row filters (top-k /
top-p keep the eager sort): from the logits, each row's log-probabilities (tempered; greedy
rows carry temperature 1), the distribution it samples from (one-hot at the argmax for greedy
rows, else exp(logp)) and, given a uniform per row, its token by the inverse CDF, exactly the
eager `target_logprobs`, `sampling_probs` and `rng.sample_inverse_cdf` (to rounding:
kernels/sample_triton.py). Those are ~15 small launches a sampling site eagerly; a decode
step has one, a speculative step one per draft depth and the verify pass.
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
