"""Sampling parameters and the sampling distribution (temperature, top-k, top-p, greedy)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from birkhoff.engine.sampling import (
    RowSampling,
    SamplingParams,
    filter_top_k_top_p,
    sample_logits,
    sampling_probs,
    target_logprobs,
)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("stop_token_ids", (1, -2)),
        ("seed", 1.5),
        ("num_speculative_tokens", -1),
    ],
)
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    kwargs: dict[str, object] = {"max_new_tokens": 4, field: value}
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_defaults_and_positional_max_new_tokens() -> None:
    p = SamplingParams(8, stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert p.greedy and p.top_p == 1 and p.top_k == 0 and p.num_speculative_tokens == 0
    assert p.stop_token_ids == (3, 4)


def naive_filter(z: list[float], top_k: int, top_p: float) -> list[float]:
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = order[:top_k] if top_k else order
    total = sum(math.exp(z[i]) for i in keep)
    kept, mass = [], 0.0
    for i in keep:
        if top_p < 1 and mass >= top_p:
            break
        kept.append(i)
        mass += math.exp(z[i]) / total
    return [z[i] if i in kept else -math.inf for i in range(len(z))]


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (3, 1.0), (0, 0.6), (4, 0.8), (1, 0.5)])
def test_top_k_top_p_filter_matches_naive(top_k: int, top_p: float) -> None:
    z_AV = torch.randn(6, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out_AV = filter_top_k_top_p(z_AV, torch.full((6,), top_k), torch.full((6,), top_p))
    rows = [naive_filter(row, top_k, top_p) for row in z_AV.tolist()]
    expected = torch.tensor(rows, dtype=torch.float64)
    assert torch.equal(out_AV, expected)


def test_target_logprobs_per_row_params() -> None:
    params = [
        SamplingParams(1),  # greedy: untempered softmax
        SamplingParams(1, temperature=0.5),
        SamplingParams(1, temperature=2.0, top_k=2),
    ]
    rs = RowSampling.build(params, torch.device("cpu"))
    logits_AV = torch.tensor([[1.0, 2.0, 3.0, 0.5]] * 3, dtype=torch.float64)
    logp_AV = target_logprobs(logits_AV, rs)
    torch.testing.assert_close(logp_AV[0], logits_AV[0].log_softmax(-1))
    torch.testing.assert_close(logp_AV[1], (logits_AV[1] / 0.5).log_softmax(-1))
    top2 = torch.tensor([-math.inf, 1.0, 1.5, -math.inf], dtype=torch.float64)
    torch.testing.assert_close(logp_AV[2], top2.log_softmax(-1))
    probs_AV = sampling_probs(logp_AV, rs.greedy_A)
    assert probs_AV[0].tolist() == [0.0, 0.0, 1.0, 0.0]  # greedy samples the argmax
    torch.testing.assert_close(probs_AV[1:], logp_AV[1:].exp())


def previous_sample_logits(logits_AV: torch.Tensor, rs: RowSampling) -> tuple[torch.Tensor, ...]:
    """The former formulation: an fp32 copy of the logits, then the division; an int64 one-hot."""
    z_AV = logits_AV.to(torch.promote_types(logits_AV.dtype, torch.float32))
    z_AV = z_AV / rs.temperature_A.to(z_AV.dtype)[:, None]
    if rs.filtered:
        z_AV = filter_top_k_top_p(z_AV, rs.top_k_A, rs.top_p_A)
    logp_AV = z_AV.log_softmax(dim=-1)
    one_hot_AV = F.one_hot(logp_AV.argmax(dim=-1), logp_AV.shape[-1]).to(logp_AV.dtype)
    return logp_AV, torch.where(rs.greedy_A[:, None], one_hot_AV, logp_AV.exp())


class LargeOutputs(TorchDispatchMode):
    """Records (op, dtype) of every op output with at least `numel` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.seen.append((func.overloadpacket.__name__, t.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("filtered", [False, True])
def test_sampling_from_bf16_logits_is_bit_exact_without_an_fp32_copy(
    dtype: torch.dtype, filtered: bool
) -> None:
    top_k, top_p = (5, 0.9) if filtered else (0, 1.0)
    params = [
        SamplingParams(1),
        SamplingParams(1, temperature=0.7),
        SamplingParams(1, temperature=1.3, top_k=top_k, top_p=top_p),
    ]
    rs = RowSampling.build(params, torch.device("cpu"))
    assert rs.filtered == filtered
    logits_AV = torch.randn(3, 257, generator=torch.Generator().manual_seed(1)).to(dtype)
    with LargeOutputs(logits_AV.numel()) as ops:
        logp_AV, probs_AV = sample_logits(logits_AV, rs)
    want_logp, want_probs = previous_sample_logits(logits_AV, rs)
    assert torch.equal(logp_AV, want_logp) and torch.equal(probs_AV, want_probs)
    assert ("_to_copy", torch.float32) not in ops.seen  # no fp32 copy of the logits
    assert all(d != torch.int64 for op, d in ops.seen if op != "sort")  # no int64 one-hot
