"""Block fp8: error bound, idempotence, layout against a per-block fp64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from birkhoff.engine.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
    scale_shape,
)


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def reference_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-by-block loop, amax in fp64; the same scale and rounding rule, no padding tricks."""
    rows, cols = w.shape
    num_r, num_c = math.ceil(rows / block), math.ceil(cols / block)
    q = torch.empty(rows, cols, dtype=FP8_DTYPE)
    scale_inv = torch.empty(num_r, num_c, dtype=torch.float32)
    for i in range(num_r):
        for j in range(num_c):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block].double()
            amax = torch.tensor(tile.abs().max().item(), dtype=torch.float32)
            s = amax.clamp_min(torch.finfo(torch.float32).tiny * FP8_MAX) * (1.0 / FP8_MAX)
            scale_inv[i, j] = s
            scaled = tile.float() * (1.0 / s)
            assert scaled.abs().max() < 480  # the cast rounds below 480 to <= 448
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = scaled.to(FP8_DTYPE)
    return q, scale_inv


@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    log_scale=st.floats(-12, 6),
    outlier=st.booleans(),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_per_element_error_bound(
    rows: int, cols: int, log_scale: float, outlier: bool, bf16: bool, seed: int
) -> None:
    """|w - dq| <= 2^-4 |w| + 2^-10 scale_inv (+ fp32 rounding), hence per block <= amax/16."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 10.0**log_scale
    if outlier:
        w[rows // 2, cols // 2] *= 1000.0
    if bf16:
        w = w.bfloat16()
    q, scale_inv = quantize_fp8_blockwise(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale_inv.dtype == torch.float32 and tuple(scale_inv.shape) == scale_shape(w.shape)
    w32 = w.float()
    err = (w32 - dequantize_fp8_blockwise(q, scale_inv)).abs()
    scale_full = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    bound = (2.0**-4 * w32.abs() + 2.0**-10 * scale_full) * (1 + 1e-6)
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3e}"
    # the per-block relative statement the docs make: max error <= amax / 16
    amax_full = scale_full * FP8_MAX
    assert bool((err <= amax_full / 16 * (1 + 1e-5)).all())


@given(rows=st.integers(1, 260), cols=st.integers(1, 260), seed=st.integers(0, 2**16),
       out_dtype=st.sampled_from([torch.float32, torch.bfloat16]))  # fmt: skip
@settings(max_examples=40, deadline=None)
def test_quantize_dequantized_reproduces_codes(
    rows: int, cols: int, seed: int, out_dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(seed)
    q, scale_inv = quantize_fp8_blockwise(torch.randn(rows, cols, generator=g) * 0.02)
    q2, scale_inv2 = quantize_fp8_blockwise(dequantize_fp8_blockwise(q, scale_inv, dtype=out_dtype))
    assert torch.equal(bits(q2), bits(q))
    torch.testing.assert_close(scale_inv2, scale_inv, rtol=2**-7, atol=0)


@pytest.mark.parametrize("shape,block", [((9, 7), 4), ((8, 8), 4), ((1, 13), 5), ((130, 257), 128)])
def test_matches_per_block_reference(shape: tuple[int, int], block: int) -> None:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    w[0, :] = 0.0  # a row of zeros inside a block must not disturb its neighbours
    q, scale_inv = quantize_fp8_blockwise(w, block=block)
    q_ref, scale_ref = reference_quantize(w, block)
    torch.testing.assert_close(scale_inv, scale_ref, rtol=1e-6, atol=0)
    assert torch.equal(bits(q), bits(q_ref))


def test_block_max_maps_to_fp8_max_and_zero_block_is_finite() -> None:
    w = torch.zeros(256, 128)
    w[:128] = torch.randn(128, 128)
    q, scale_inv = quantize_fp8_blockwise(w)
    assert q[:128].float().abs().max().item() == FP8_MAX
    assert bool(torch.isfinite(scale_inv).all()) and scale_inv[1, 0].item() > 0
    assert not bool(q[128:].float().any())
    assert not bool(dequantize_fp8_blockwise(q, scale_inv)[128:].any())


def test_bad_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_blockwise(torch.randn(4))
    with pytest.raises(ValueError, match="block"):
        quantize_fp8_blockwise(torch.randn(4, 4), block=0)
    q, scale_inv = quantize_fp8_blockwise(torch.randn(200, 100))
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_fp8_blockwise(q, scale_inv[:1])


def test_out_receives_the_same_bits_and_bad_out_is_rejected() -> None:
    w = torch.randn(200, 300)
    q, scale_inv = quantize_fp8_blockwise(w)
    buffer = torch.zeros(200 * 300 + 4 * 2 * 3, dtype=torch.uint8)  # codes, then scales
    out = (buffer[: 200 * 300].view(FP8_DTYPE).view(200, 300),
           buffer[200 * 300 :].view(torch.float32).view(2, 3))  # fmt: skip
    got = quantize_fp8_blockwise(w, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out[1], scale_inv)
    with pytest.raises(ValueError, match=r"out scale_inv: expected contiguous .*\[2, 3\]"):
        quantize_fp8_blockwise(w, out=(out[0], torch.empty(3, 2)))
    with pytest.raises(ValueError, match="out q: .*contiguous=False"):
        quantize_fp8_blockwise(w, out=(torch.empty(300, 200, dtype=FP8_DTYPE).t(), out[1]))
