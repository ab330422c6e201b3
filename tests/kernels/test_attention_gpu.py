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


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == 1], ids=case_id)
def test_decode_attention_rope_equals_rope_cache_then_attention(case: tuple) -> None:
    check_attention_rope("cuda", case)
