"""Fused decode attention on CUDA against SDPA with the engine's mask (the engine's greedy
tokens with every fused op are test_mhc_gpu.py's)."""

from __future__ import annotations

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

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_attention_matches_sdpa(case: tuple) -> None:
    check_decode_attention("cuda", case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_attention_does_not_depend_on_the_key_bucket(case: tuple) -> None:
    check_limit_independent("cuda", case)


@pytest.mark.parametrize("case", CASES[1:2] + CASES[4:5], ids=case_id)
def test_decode_attention_reads_strided_positions_and_a_broadcast_live_flag(case: tuple) -> None:
    check_strided_positions("cuda", case)


@pytest.mark.parametrize(("hb", "bn"), [(2, 32), (4, 64), (8, 64)])
@pytest.mark.parametrize("case", [CASES[i] for i in (0, 3, 7)], ids=case_id)
def test_decode_attention_heads_kernel(
    case: tuple, hb: int, bn: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_heads_kernel("cuda", case, hb, bn, monkeypatch)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_attention_rope_equals_rope_cache_then_attention(case: tuple) -> None:
    check_attention_rope("cuda", case)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == 1 and c[2] == c[3]], ids=case_id)
def test_decode_attention_rope_through_the_heads_kernel(
    case: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    from birkhoff.kernels import attention

    monkeypatch.setattr(attention, "HEADS", dict(attention.HEADS, PAIRS=0))
    check_attention_rope("cuda", case)
    check_limit_independent("cuda", case)


def test_the_heads_kernel_serves_large_batches_by_default() -> None:
    """h200-small's 12 heads at 128 rows: the default launch takes the several-heads kernel,
    with and without rope; below PAIRS (row, kv head) pairs, or with GQA or several tokens a
    row, the per-head kernel."""
    from birkhoff.kernels.attention import HEADS, heads_kernel

    assert heads_kernel(128, 1, 12, 12) and HEADS["PAIRS"] <= 128 * 12
    assert not any(heads_kernel(*s) for s in ((64, 1, 12, 12), (256, 3, 12, 12), (256, 1, 12, 4)))
    case = (torch.bfloat16, 1, 12, 12, 64, 129, 300, 130)  # 128 rows
    check_decode_attention("cuda", case)
    check_limit_independent("cuda", case)
    check_attention_rope("cuda", case)
