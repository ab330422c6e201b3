"""Shared checks of the fused per-row sampling (kernels/sample.py) against the eager functions
of engine/sampling.py and rng.sample_inverse_cdf, run in the Triton interpreter on CPU
(rng_interpret_cases.py) and on CUDA (test_rng_gpu.py).

Tolerances (kernels/sample_triton.py): logp within 1e-5 of max(1, |logp|), probs within the
same relative error of logp (|dp| ~ p |dlogp|; GPU exp and log are approximations);
greedy tokens exactly the argmax; sampled tokens equal to the eager draws with the same
uniforms (the rounding differences would have to land u * total within ~1e-6 of a boundary).
"""

from __future__ import annotations

import pytest
import torch

from birkhoff.engine.rng import sample_inverse_cdf
from birkhoff.engine.sampling import RowSampling, sample_tokens
from birkhoff.kernels.sample import sample_rows

# (rows, vocab, logits dtype, logit scale): one block and several, V no power of two, V = 1,
# peaked rows (large scale: most mass on one token) and flat ones
SAMPLE_CASES = [(5, 37, torch.float32, 3.0), (3, 2500, torch.bfloat16, 3.0),
                (4, 1, torch.float32, 1.0), (6, 1024, torch.float16, 1.0),
                (8, 300, torch.float32, 40.0), (0, 16, torch.float32, 1.0)]  # fmt: skip


def _inputs(device: str, N: int, V: int, dtype: torch.dtype, scale: float) -> RowSampling:
    g = torch.Generator().manual_seed(N * 1000 + V)
    greedy = torch.rand(N, generator=g) < 0.4
    temperature = torch.where(greedy, 1.0, torch.rand(N, generator=g) * 1.5 + 0.2)
    return RowSampling(temperature.to(device), torch.zeros(N, dtype=torch.long, device=device),
                       torch.ones(N, device=device), greedy.to(device), False)  # fmt: skip


def _largest(t: torch.Tensor) -> float:
    return t.max().item() if t.numel() else 0.0


def check_sample_rows(device: str, case: tuple) -> None:
    N, V, dtype, scale = case
    rs = _inputs(device, N, V, dtype, scale)
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(N, V, generator=g) * scale).to(device, dtype)
    u = torch.rand(N, generator=g, dtype=torch.float64).to(device)
    logp, probs, token = sample_tokens(logits, rs, u, "eager")
    f_logp, f_probs, f_token = sample_tokens(logits, rs, u, "triton")
    assert f_logp.dtype == torch.float32 and f_probs.shape == (N, V) and f_token is not None
    assert _largest((f_logp - logp).abs() / logp.abs().clamp(min=1)) <= 1e-5
    bound = 1e-5 * probs * logp.abs().clamp(min=1) + 1e-12
    assert _largest((f_probs - probs).abs() - bound) <= 0
    assert torch.equal(f_token, token)
    assert torch.equal(f_probs[rs.greedy_A], probs[rs.greedy_A])  # one-hot at the argmax
    _, _, greedy_token = sample_rows(logits, rs.temperature_A, rs.greedy_A, None)
    if N:
        assert torch.equal(greedy_token, logp.argmax(-1))
    assert sample_tokens(logits, rs, None, "triton")[2] is None


def check_sample_edges(device: str) -> None:
    """u near 1 draws the last token with mass, never a zero-mass one after it; ties of the
    largest logit give the first; wrong inputs are ValueErrors naming the argument."""
    logits = torch.tensor([[0.0, 5.0, 5.0, -float("inf")], [1.0, 1.0, -float("inf"), 3.0]],
                          device=device)  # fmt: skip
    rs = RowSampling(torch.ones(2, device=device), torch.zeros(2, dtype=torch.long,
                     device=device), torch.ones(2, device=device),
                     torch.tensor([False, False], device=device), False)  # fmt: skip
    u = torch.tensor([1 - 2**-53, 0.0], dtype=torch.float64, device=device)
    _, probs, token = sample_tokens(logits, rs, u, "triton")
    assert token is not None and token.tolist() == [2, 0]
    assert token.tolist() == sample_inverse_cdf(probs, u).tolist()
    greedy = sample_rows(logits, rs.temperature_A, rs.greedy_A, None)[2]
    assert greedy.tolist() == [1, 3]
    with pytest.raises(ValueError, match="temperature must be torch.float32 of shape"):
        sample_rows(logits, rs.temperature_A.double(), rs.greedy_A, u)
    with pytest.raises(ValueError, match="u must be torch.float64 of shape"):
        sample_rows(logits, rs.temperature_A, rs.greedy_A, u[:1])
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        sample_rows(logits[None], rs.temperature_A, rs.greedy_A, u)
