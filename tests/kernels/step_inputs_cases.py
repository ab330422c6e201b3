"""Shared checks of a plain decode step's fused inputs (kernels/step_inputs.py) against the
eager gathers they replace, run in the Triton interpreter on CPU (rng_interpret_cases.py) and
on CUDA (test_rng_gpu.py): the same values bit for bit."""

from __future__ import annotations

import pytest
import torch

from birkhoff.kernels.step_inputs import ROWS, decode_inputs
from birkhoff.model.layers import rope_tables

# (rows of the step, cache rows, head dim): one program and several, a head dim whose angles
# are no power of two
INPUT_CASES = [(1, 1, 64), (5, 8, 64), (2 * ROWS + 3, 40, 24)]


def check_decode_inputs(device: str, A: int, B: int, K: int) -> None:
    g = torch.Generator().manual_seed(A)
    N = 50
    trash = N - 1
    cos, sin = rope_tables(torch.arange(N, device=device), K, 10000.0)
    tokens = torch.randint(0, 1000, (B, N), generator=g).to(device)
    rows = torch.randperm(B, generator=g)[:A].to(device) if A <= B else torch.arange(A) % B
    rows = rows.to(device)
    n = torch.randint(0, N - 1, (A,), generator=g).to(device)
    live = (torch.rand(A, generator=g) < 0.7).long().to(device)
    positions, valid, c, s, tok = decode_inputs(n, live, rows, tokens, cos, sin, trash)
    expected = torch.where(live.bool(), n, trash)[:, None]
    assert torch.equal(positions, expected) and torch.equal(valid, live.bool()[:, None])
    assert torch.equal(c, cos[expected]) and torch.equal(s, sin[expected])
    assert torch.equal(tok, tokens[rows[:, None], expected])
    assert c.dtype == cos.dtype and tok.dtype == torch.long


def check_decode_inputs_errors(device: str) -> None:
    cos, sin = rope_tables(torch.arange(8, device=device), 8, 10000.0)
    tokens = torch.zeros(2, 8, dtype=torch.long, device=device)
    n = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="rows must be 2 entries of int64"):
        decode_inputs(n, n, n.int(), tokens, cos, sin, 7)
    with pytest.raises(ValueError, match="trash slot 8 outside"):
        decode_inputs(n, n, n, tokens, cos, sin, 8)
    with pytest.raises(ValueError, match="rope tables"):
        decode_inputs(n, n, n, tokens, cos, sin[:, :2], 7)
