"""Shared checks of the fused per-row sampling (kernels/sample.py) against the eager functions
of engine/sampling.py (sample_tokens, sample_inverse_cdf), run in the Triton interpreter on CPU
(rng_interpret_cases.py) and on CUDA (test_rng_gpu.py); and the fused sampling site of a plain
decode step (`sample_next`) against the launches it replaces.

Tolerances (kernels/sample_triton.py): logp within 1e-5 of max(1, |logp|), probs within the
same relative error of logp (|dp| ~ p |dlogp|; GPU exp and log are approximations);
greedy tokens exactly the argmax; sampled tokens equal to the eager draws with the same
uniforms (the rounding differences would have to land u * total within ~1e-6 of a boundary).
"""

from __future__ import annotations

import pytest
import torch

from birkhoff.engine.rng import DRAFT, SAMPLE, TAGS, RequestRandom
from birkhoff.engine.sampling import (
    RowSampling,
    SamplingParams,
    SamplingTable,
    sample_inverse_cdf,
    sample_tokens,
)
from birkhoff.kernels.sample import sample_next, sample_rows

# (rows, vocab, logits dtype, logit scale): one block and several, V no power of two, V = 1,
# peaked rows (large scale: most mass on one token) and flat ones
SAMPLE_CASES = [(5, 37, torch.float32, 3.0), (3, 2500, torch.bfloat16, 3.0),
                (4, 1, torch.float32, 1.0), (6, 1024, torch.float16, 1.0),
                (8, 300, torch.float32, 40.0), (0, 16, torch.float32, 1.0)]  # fmt: skip
NEXT_CASES = [(37, torch.float32), (2500, torch.bfloat16), (1, torch.float32)]  # V, dtype


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
    logp, probs, token = sample_tokens(logits, rs, u)
    f_logp, f_probs, f_token = sample_rows(logits, rs.temperature_A, rs.greedy_A, u)
    assert f_logp.dtype == torch.float32 and f_probs.shape == (N, V) and f_token is not None
    assert _largest((f_logp - logp).abs() / logp.abs().clamp(min=1)) <= 1e-5
    bound = 1e-5 * probs * logp.abs().clamp(min=1) + 1e-12
    assert _largest((f_probs - probs).abs() - bound) <= 0
    assert torch.equal(f_token, token)
    assert torch.equal(f_probs[rs.greedy_A], probs[rs.greedy_A])  # one-hot at the argmax
    _, _, greedy_token = sample_rows(logits, rs.temperature_A, rs.greedy_A, None)
    if N:
        assert torch.equal(greedy_token, logp.argmax(-1))


def check_sample_edges(device: str) -> None:
    """u near 1 draws the last token with mass, never a zero-mass one after it; ties of the
    largest logit give the first; wrong inputs are ValueErrors naming the argument."""
    logits = torch.tensor([[0.0, 5.0, 5.0, -float("inf")], [1.0, 1.0, -float("inf"), 3.0]],
                          device=device)  # fmt: skip
    rs = RowSampling(torch.ones(2, device=device), torch.zeros(2, dtype=torch.long,
                     device=device), torch.ones(2, device=device),
                     torch.tensor([False, False], device=device), False)  # fmt: skip
    u = torch.tensor([1 - 2**-53, 0.0], dtype=torch.float64, device=device)
    _, probs, token = sample_rows(logits, rs.temperature_A, rs.greedy_A, u)
    assert token is not None and token.tolist() == [2, 0]
    assert token.tolist() == sample_inverse_cdf(probs, u).tolist()
    greedy = sample_rows(logits, rs.temperature_A, rs.greedy_A, None)[2]
    assert greedy.tolist() == [1, 3]
    with pytest.raises(ValueError, match="temperature must be a torch.float32 tensor of shape"):
        sample_rows(logits, rs.temperature_A.double(), rs.greedy_A, u)
    with pytest.raises(ValueError, match="u must be a torch.float64 tensor of shape"):
        sample_rows(logits, rs.temperature_A, rs.greedy_A, u[:1])
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        sample_rows(logits[None], rs.temperature_A, rs.greedy_A, u)


def check_sample_next(device: str, V: int, dtype: torch.dtype) -> None:
    """A step's fused sampling site equals the launches it replaces: the rows' parameters
    gathered from the tables, RequestRandom's uniforms, sample_rows, the token written at
    n + offset (trash where not live), (token, logp) as fp64: the same bits (probs too); and
    the eager functions' tokens, logp within sample_rows' tolerance."""
    dev = torch.device(device)
    R, N, trash = 6, 40, 39
    g = torch.Generator().manual_seed(V)
    params = [SamplingParams(4, temperature=t) for t in (0.0, 0.7, 1.3, 0.0, 1.0, 0.3)]
    table = SamplingTable(R, dev)
    table.assign(list(range(R)), params)
    keys = [RequestRandom.request_key(seed=5, request=r) for r in range(R)]
    rngs = {k: RequestRandom(R, dev, k) for k in ("triton", "eager")}
    for rng in rngs.values():
        rng.assign(list(range(R)), keys)
    rows = torch.tensor([4, 0, 2, 5, 1], device=dev)
    n = torch.tensor([3, 0, 17, 36, 9], device=dev)
    live = torch.tensor([True, True, True, False, True], device=dev)
    logits = (torch.randn(len(rows), V, generator=g) * 3).to(dev, dtype)
    tokens = torch.randint(0, V, (R, N), generator=g).to(dev)
    tables = (table.params.temperature_A, table.params.greedy_A, rngs["triton"].keys_R)
    rs = table.select(rows, filtered=False)
    for tag, offset in ((SAMPLE, 1), (DRAFT + 2, 2)):
        expected_tokens = tokens.clone()
        out, token, probs = sample_next(logits, rows, n, live, *tables, tokens, trash, TAGS, tag,
                                        offset)  # fmt: skip
        for kernels, rng in rngs.items():
            u = rng.uniform(rows, n, tag)
            if kernels == "triton":  # the fused row arithmetic with the same uniforms
                logp, p, t = sample_rows(logits, rs.temperature_A, rs.greedy_A, u)
            else:
                logp, p, t_or_none = sample_tokens(logits, rs, u)
                assert t_or_none is not None
                t = t_or_none
            lp = logp.gather(-1, t[:, None]).squeeze(-1).double()
            assert torch.equal(token, t) and torch.equal(out[:, 0], t.double()), kernels
            if kernels == "triton":
                assert torch.equal(out[:, 1], lp), (out[:, 1] - lp).abs().max()
                assert torch.equal(probs, p), (probs - p).abs().max()
                expected_tokens[rows, torch.where(live, n + offset, trash)] = t
                assert torch.equal(tokens, expected_tokens)
            else:
                assert _largest((out[:, 1] - lp).abs() / lp.abs().clamp(min=1)) <= 1e-5
    with pytest.raises(ValueError, match="rows must be a contiguous torch.int64 tensor"):
        sample_next(logits, rows.int(), n, live, *tables, tokens, trash, TAGS, SAMPLE, 1)
    with pytest.raises(ValueError, match="trash slot 40 outside"):
        sample_next(logits, rows, n, live, *tables, tokens, N, TAGS, SAMPLE, 1)
