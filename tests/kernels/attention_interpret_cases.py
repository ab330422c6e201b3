"""Fused decode attention against SDPA under the Triton interpreter on CPU (run by
test_mhc_interpret.py in a fresh process)."""

from __future__ import annotations

import os

import pytest
import torch
from attention_cases import (
    CASES,
    case_id,
    check_attention_rope,
    check_decode_attention,
    check_heads_kernel,
    check_limit_independent,
    check_strided_positions,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_attention_matches_sdpa(case: tuple) -> None:
    check_decode_attention("cpu", case)


@pytest.mark.parametrize("case", CASES[2:4], ids=case_id)
def test_decode_attention_does_not_depend_on_the_key_bucket(case: tuple) -> None:
    check_limit_independent("cpu", case)


# every tile on the small case (8 heads a block: a partial block at 4 heads); bf16 once; the
# three splits with a partial head block (6 heads, 4 a block)
HEADS_TILES = [
    (CASES[0], 2, 32),
    (CASES[0], 4, 64),
    (CASES[0], 8, 16),
    (CASES[3], 2, 32),
    (CASES[7], 4, 64),
]


@pytest.mark.parametrize(("case", "hb", "bn"), HEADS_TILES, ids=str)
def test_decode_attention_heads_kernel(
    case: tuple, hb: int, bn: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T = 1 and H = G through the several-heads kernel."""
    check_heads_kernel("cpu", case, hb, bn, monkeypatch)


def test_decode_attention_rejects_a_bad_heads_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    from birkhoff.kernels import attention

    q, k = torch.randn(2, 1, 4, 16), torch.randn(3, 4, 32, 16)
    rows, pos, valid = torch.arange(2), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1).bool()
    for hb, bn in ((3, 48), (4, 2)):
        monkeypatch.setattr(attention, "HEADS", dict(attention.HEADS, HB=hb, BN=bn, PAIRS=0))
        with pytest.raises(ValueError, match=f"HB {hb} must be a power of two dividing BN {bn}"):
            attention.decode_attention(q, k, k, rows, pos, valid, 8)


def test_decode_attention_rejects_bad_shapes() -> None:
    from birkhoff.kernels.attention import decode_attention

    q, k = torch.randn(2, 1, 6, 16), torch.randn(3, 4, 32, 16)
    rows, pos, valid = torch.arange(2), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1).bool()
    with pytest.raises(ValueError, match="vs cache"):
        decode_attention(q, k, k, rows, pos, valid, 8)
    with pytest.raises(ValueError, match="limit 40 exceeds 32"):
        decode_attention(q[:, :, :4], k, k, rows, pos, valid, 40)


def test_custom_op_registration() -> None:
    from birkhoff.kernels.attention import decode_attention

    q, k = torch.randn(2, 3, 4, 16), torch.randn(3, 2, 32, 16)
    rows, pos = torch.tensor([2, 0]), torch.tensor([[4, 5, 6], [0, 1, 31]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    torch.library.opcheck(decode_attention, (q, k, k, rows, pos, valid, 20))


def test_rope_custom_op_registration() -> None:
    from birkhoff.kernels.attention import decode_attention_rope

    q, new, cos = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.rand(2, 1, 8)
    k, v = torch.randn(3, 2, 32, 16), torch.randn(3, 2, 32, 16)
    rows, pos, valid = torch.tensor([2, 0]), torch.tensor([[4], [9]]), torch.ones(2, 1).bool()
    args = (q, new, new, cos, cos, k, v, rows, pos, valid, 20)
    torch.library.opcheck(decode_attention_rope, args)


@pytest.mark.parametrize("case", CASES[1:2] + CASES[4:5], ids=case_id)
def test_decode_attention_reads_strided_positions_and_a_broadcast_live_flag(case: tuple) -> None:
    check_strided_positions("cpu", case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_attention_rope_equals_rope_cache_then_attention(case: tuple) -> None:
    check_attention_rope("cpu", case)


def test_decode_attention_rope_with_the_heads_kernel_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `attention.HEADS` on at every row count, H = G rows rotate and write their token in
    the several-heads kernel (a padded row, several splits)."""
    from birkhoff.kernels import attention

    monkeypatch.setattr(attention, "HEADS", dict(attention.HEADS, HB=2, BN=32, PAIRS=0))
    for case in (CASES[0], CASES[7]):
        check_attention_rope("cpu", case)


def test_decode_attention_rope_rejects_bad_shapes() -> None:
    from birkhoff.kernels.attention import decode_attention_rope

    q, k = torch.randn(2, 1, 4, 16), torch.randn(3, 4, 32, 16)
    new, cos = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 8)
    rows, pos, valid = torch.arange(2), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1).bool()
    with pytest.raises(ValueError, match="the chunk's q, k and v"):  # 2 query tokens, 1 key
        decode_attention_rope(q.expand(2, 2, 4, 16), new, new, cos, cos, k, k, rows, pos, valid, 8)
    with pytest.raises(ValueError, match=r"angles \(2, 1, 4\)"):
        decode_attention_rope(q, new, new, cos[..., :4], cos[..., :4], k, k, rows, pos, valid, 8)
