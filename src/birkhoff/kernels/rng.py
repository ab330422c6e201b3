"""The engine's counter-based uniforms as one fused custom op (`birkhoff::splitmix_uniform`).

Legend: N draws.

`engine.rng.RequestRandom.uniform` dispatches here when fused kernels are on; the eager
`splitmix64` (~20 int64 elementwise kernels a draw) stays the reference and the CPU path. The
kernel gives the same bits from uint64 arithmetic in registers (`uniform_bits`, also drawn
inside the sampling and verify kernels). No host sync, so it runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.common import check_device, tl, triton


@triton.jit
def uniform_bits(key, counter):
    """fp64 uniforms in [0, 1): the top 53 bits of splitmix64(key ^ counter) (int64 tensors)."""
    z = key.to(tl.uint64, bitcast=True) ^ counter.to(tl.uint64, bitcast=True)
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return (z >> 11).to(tl.float64) * 1.1102230246251565e-16  # 53 random bits -> [0, 1), exactly


@triton.jit
def splitmix_uniform_kernel(key_ptr, counter_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    key = tl.load(key_ptr + i, mask=ok, other=0)
    counter = tl.load(counter_ptr + i, mask=ok, other=0)
    tl.store(out_ptr + i, uniform_bits(key, counter), mask=ok)


BLOCK = 256


@torch.library.custom_op("birkhoff::splitmix_uniform", mutates_args=())
def splitmix_uniform(key: Tensor, counter: Tensor) -> Tensor:
    """fp64 uniforms in [0, 1): the top 53 bits of splitmix64(key ^ counter), elementwise over
    int64 tensors of one shape."""
    check_device(key)
    if key.shape != counter.shape or key.dtype != torch.long or counter.dtype != torch.long:
        raise ValueError(
            f"key and counter must be int64 of one shape, got {key.dtype}{tuple(key.shape)} and "
            f"{counter.dtype}{tuple(counter.shape)}"
        )
    key, counter = key.contiguous(), counter.contiguous()
    out = torch.empty(key.shape, dtype=torch.float64, device=key.device)
    N = key.numel()
    if N:
        splitmix_uniform_kernel[(-(-N // BLOCK),)](key, counter, out, N, BLOCK=BLOCK)
    return out


@splitmix_uniform.register_fake
def _(key, counter):  # type: ignore[no-untyped-def]
    return torch.empty(key.shape, dtype=torch.float64, device=key.device)
