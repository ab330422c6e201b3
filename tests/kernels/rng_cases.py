"""Shared checks of the fused splitmix64 uniforms (kernels/rng.py) against the eager reference,
run in the Triton interpreter on CPU (rng_interpret_cases.py) and on CUDA (test_rng_gpu.py)."""

from __future__ import annotations

import torch

from birkhoff.engine.rng import RequestRandom, splitmix64
from birkhoff.kernels.rng import splitmix_uniform

SIZES = [0, 1, 7, 256, 1000]


def check_uniform_bits(device: str, size: int) -> None:
    """Bit-identical to the eager splitmix64 over the whole int64 range (negative keys too)."""
    gen = torch.Generator().manual_seed(size)
    key = torch.randint(-(2**63), 2**63 - 1, (size,), generator=gen, dtype=torch.long)
    counter = torch.randint(0, 2**40, (size,), generator=gen, dtype=torch.long)
    key, counter = key.to(device), counter.to(device)
    bits = splitmix64(key ^ counter)
    expected = ((bits >> 11) & ((1 << 53) - 1)).double() * 2.0**-53
    assert torch.equal(splitmix_uniform(key, counter), expected)


def check_request_random(device: str) -> None:
    """RequestRandom with fused kernels draws exactly the eager uniforms, broadcasting included."""
    fused, eager = (RequestRandom(5, torch.device(device), k) for k in ("triton", "eager"))
    keys = [RequestRandom.request_key(seed=3, request=r) for r in range(5)]
    for rng in (fused, eager):
        rng.assign(list(range(5)), keys)
    rows = torch.tensor([4, 0, 2], device=device)
    positions = torch.tensor([17, 3, 900], device=device)
    tags = torch.arange(1, 4, device=device)
    for args in ((rows, positions, 0), (rows[:, None], positions[:, None], tags[None, :])):
        assert torch.equal(fused.uniform(*args), eager.uniform(*args))
