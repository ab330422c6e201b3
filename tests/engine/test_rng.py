"""Per-request counter-based random numbers: the hash, uniforms, inverse-CDF sampling."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import chi_square_pvalue

from birkhoff.engine.rng import (
    ACCEPT,
    SAMPLE,
    RequestRandom,
    splitmix64,
    splitmix64_reference,
)
from birkhoff.engine.sampling import sample_inverse_cdf

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_splitmix64_matches_the_uint64_reference(device: str) -> None:
    xs = [0, 1, 2, 12345, (1 << 63) - 1, -1, -(1 << 63), 0x0123456789ABCDEF]
    got = splitmix64(torch.tensor(xs, device=device)).tolist()
    want = [splitmix64_reference(x & ((1 << 64) - 1)) for x in xs]
    assert [g & ((1 << 64) - 1) for g in got] == want


def test_uniforms_are_keyed_and_uniform() -> None:
    rng = RequestRandom(3, torch.device("cpu"))
    for row, request in enumerate((0, 1, 0)):
        rng.assign([row], [RequestRandom.request_key(seed=7, request=request)])
    positions = torch.arange(20000)
    rows = torch.zeros_like(positions)
    u0 = rng.uniform(rows, positions, SAMPLE)
    assert torch.equal(u0, rng.uniform(rows + 2, positions, SAMPLE))  # same request, same numbers
    assert not torch.equal(u0, rng.uniform(rows + 1, positions, SAMPLE))  # another request
    assert not torch.equal(u0, rng.uniform(rows, positions, ACCEPT + 1))  # another tag
    assert u0.min() >= 0 and u0.max() < 1
    counts = torch.histc(u0, bins=20, min=0, max=1)
    assert chi_square_pvalue(counts, torch.full((20,), 0.05)) > 1e-3
    other_seed = RequestRandom.request_key(seed=8, request=0)
    assert other_seed != RequestRandom.request_key(seed=7, request=0)


def test_inverse_cdf_sampling_is_exact_and_skips_zero_mass() -> None:
    p_V = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0], dtype=torch.float64)
    u_N = torch.rand(30000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = sample_inverse_cdf(p_V.expand(len(u_N), -1) * 3.0, u_N)  # unnormalised is fine
    counts = torch.bincount(tokens, minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert chi_square_pvalue(counts, p_V) > 1e-3
    edge = torch.tensor([0.0, 1.0 - 2.0**-53])  # the extremes of [0, 1)
    assert sample_inverse_cdf(p_V.expand(2, -1), edge).tolist() == [1, 4]
    one_hot = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert sample_inverse_cdf(one_hot, torch.tensor([1.0])).tolist() == [2]  # u*total == total
