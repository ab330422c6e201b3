"""The engine's counter-based uniforms as one fused custom op (`birkhoff::splitmix_uniform`).

Legend: N draws.

`engine.rng.RequestRandom.uniform` dispatches here when fused kernels are on (`use_fused`); the
eager `splitmix64` stays the reference and the CPU path, and the two are bit-identical (tested
in the Triton interpreter and on the GPU). A custom op with a fake impl, so a compiled region
calling it keeps its graph; no host sync, so it runs inside the engine's CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels import rng_triton as R
from birkhoff.kernels.mhc_mix import check_device

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
        R.splitmix_uniform[(-(-N // BLOCK),)](key, counter, out, N, BLOCK=BLOCK)
    return out


@splitmix_uniform.register_fake
def _(key, counter):  # type: ignore[no-untyped-def]
    return torch.empty(key.shape, dtype=torch.float64, device=key.device)
