"""Shared checks of a step's fused chunk inputs (kernels/step_inputs.py) against the eager ops
they replace (engine.step.step_chunk without fused kernels), run in the Triton interpreter on
CPU (rng_interpret_cases.py) and on CUDA (test_rng_gpu.py): the same values bit for bit."""

from __future__ import annotations

import pytest
import torch

from birkhoff.kernels.step_inputs import POSITIONS, chunk_inputs
from birkhoff.model.layers import rope_tables

# (rows A, cache rows B, positions T, head dim K, with start, with end, shift): a plain step,
# verify, a draft depth, a prefill and a catch-up chunk; several position blocks; a head dim
# whose angles are no power of two
INPUT_CASES = [(1, 1, 1, 64, True, False, 0), (5, 8, 3, 64, True, False, 0),
               (6, 8, 4, 24, True, True, 2), (3, 4, POSITIONS + 9, 32, False, True, 0),
               (2 * 8 + 3, 40, 5, 16, False, True, 1)]  # fmt: skip


def check_chunk_inputs(device: str, case: tuple) -> None:
    A, B, T, K, with_start, with_end, shift = case
    g = torch.Generator().manual_seed(A * 7 + T)
    N = POSITIONS + 20
    trash = N - 1
    cos, sin = rope_tables(torch.arange(N, device=device), K, 10000.0)
    tokens = torch.randint(0, 1000, (B, N), generator=g).to(device)
    rows = (torch.randperm(B, generator=g)[:A] if A <= B else torch.arange(A) % B).to(device)
    start = torch.randint(0, N - T - shift - 1, (A,), generator=g).to(device)
    end = (start if with_start else 0) + torch.randint(0, T + 1, (A,), generator=g).to(device)
    live = (torch.rand(A, generator=g) < 0.7).long().to(device)
    start_A, end_A = (start if with_start else None), (end if with_end else None)
    slots, valid, c, s, tok = chunk_inputs(start_A, end_A, live, rows, tokens, cos, sin, trash,
                                           T, shift)  # fmt: skip
    pos = torch.arange(T, device=device).expand(A, T) + (start[:, None] if with_start else 0)
    want_valid = live.bool()[:, None] & (pos < end[:, None] if with_end else pos >= 0)
    want_slots = torch.where(want_valid, pos, trash)
    assert torch.equal(valid, want_valid) and torch.equal(slots, want_slots)
    assert torch.equal(c, cos[want_slots]) and torch.equal(s, sin[want_slots])
    assert torch.equal(tok, tokens[rows[:, None], torch.where(want_valid, pos + shift, trash)])
    assert c.dtype == cos.dtype and tok.dtype == torch.long and slots.dtype == torch.long


def check_chunk_inputs_errors(device: str) -> None:
    cos, sin = rope_tables(torch.arange(8, device=device), 8, 10000.0)
    tokens = torch.zeros(2, 8, dtype=torch.long, device=device)
    n = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="rows must be 2 entries of int64"):
        chunk_inputs(n, None, n, n.int(), tokens, cos, sin, 7, 1, 0)
    with pytest.raises(ValueError, match="trash slot 8 outside"):
        chunk_inputs(n, None, n, n, tokens, cos, sin, 8, 1, 0)
    with pytest.raises(ValueError, match="rope tables"):
        chunk_inputs(n, None, n, n, tokens, cos, sin[:, :2], 7, 1, 0)
    with pytest.raises(ValueError, match="T = 0 positions"):
        chunk_inputs(n, None, n, n, tokens, cos, sin, 7, 0, 0)


# (rows A, cache rows B, positions T, streams S, dim D, with start, shift): draft depths of a
# batch-1 and a batched step, a catch-up chunk (no start, several position blocks), D no power
# of two
DEPTH_CASES = [(1, 1, 3, 4, 64, True, 1), (5, 8, 4, 2, 24, True, 2),
               (3, 4, POSITIONS + 9, 1, 32, False, 1)]  # fmt: skip


def check_depth_inputs(device: str, case: tuple) -> None:
    """`depth_inputs` equals chunk_inputs (bit for bit), the stream read, the embedding and the
    two RMSNorms of the MTP merge before its projection (to fp32 rounding: sums in another
    order), and the clamped offset of position end - 1."""
    from birkhoff.kernels.step_inputs import depth_inputs
    from birkhoff.model.layers import rms_norm

    A, B, T, S, D, with_start, shift = case
    g = torch.Generator().manual_seed(A * 5 + T)
    N, V = POSITIONS + T + 8, 50
    trash = N - 1
    cos, sin = rope_tables(torch.arange(N, device=device), 16, 10000.0)
    tokens = torch.randint(0, V, (B, N), generator=g).to(device)
    rows = torch.randperm(B, generator=g)[:A].to(device)
    start = torch.randint(0, N - T - shift - 1, (A,), generator=g).to(device)
    end = (start if with_start else 0) + torch.randint(0, T + 2, (A,), generator=g).to(device)
    live = (torch.rand(A, generator=g) < 0.8).to(device)
    h = torch.randn(B, N, S, D, generator=g).to(device)
    embed, w_h, w_e = (
        torch.randn(*shape, generator=g).to(device) for shape in ((V, D), (D,), (D,))
    )
    start_A = start if with_start else None
    got = depth_inputs(start_A, end, live, rows, tokens, cos, sin, h, embed, w_h, w_e, 1e-6,
                       trash, T, shift)  # fmt: skip
    slots, valid, c, s, tok = chunk_inputs(start_A, end, live, rows, tokens, cos, sin, trash, T,
                                           shift)  # fmt: skip
    for a, b in zip(got[:4], (slots, valid, c, s), strict=True):
        assert torch.equal(a, b)
    e = rms_norm(embed[tok], w_e, 1e-6)[:, :, None, :].expand(A, T, S, D)
    want = torch.cat((rms_norm(h[rows[:, None], slots], w_h, 1e-6), e), dim=-1)
    torch.testing.assert_close(got[4], want, rtol=1e-5, atol=1e-5)
    last = (end - 1 - (start if with_start else 0)).clamp(0, T - 1)
    assert torch.equal(got[5], last) and got[5].dtype == torch.long
