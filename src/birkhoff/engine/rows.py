"""Per-row decode state that outlives a generate call: tokens, request keys, sampling params.

Legend: B cache rows, N cache positions.

Every cache row has a token buffer (`tokens_BN`: slot p holds the token at position p, drafts
included), the position of its pending token (`n_B`, which speculative steps advance on the
device), the random key of the request in it (rng.py) and its sampling parameters
(sampling.py). They are allocated once per engine, beside the KV caches, and rewritten when a
request takes a row, so a captured CUDA graph (graphs.py) reads them at fixed addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from birkhoff.engine.rng import RequestRandom
from birkhoff.engine.sampling import SamplingTable


@dataclass(frozen=True, slots=True)
class RowState:
    tokens_BN: Tensor
    n_B: Tensor
    rng: RequestRandom
    sampling: SamplingTable

    @classmethod
    def build(cls, num_rows: int, capacity: int, device: torch.device, *, kernels: str) -> RowState:
        """`kernels`: the engine's kernel choice (fused random numbers on CUDA)."""
        tokens_BN = torch.zeros(num_rows, capacity, dtype=torch.long, device=device)
        rng = RequestRandom(num_rows, device, kernels)
        n_B = torch.zeros(num_rows, dtype=torch.long, device=device)
        return cls(tokens_BN, n_B, rng, SamplingTable(num_rows, device))
