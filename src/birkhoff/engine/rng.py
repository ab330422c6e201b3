"""Per-request random numbers: counter-based uniforms keyed by (seed, request, position, draw).

Legend: N rows (one per draw), V vocab.

Every random number a request consumes is a pure function of (seed, request index, token
position, draw tag), hashed on the device with splitmix64, so a request's tokens never depend on
batch composition, slot or `max_batch_size`. Draws are keyed by the pending token's position and
a tag distinct within a step (SAMPLE, DRAFT + k, ACCEPT + j); a row's draw from a distribution
(sampling.py) takes one uniform. Why counter-based and how the keys stay unique: docs/engine.md.
Left out: stateful generators (torch.Generator) in the engine.
"""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.engine.transfer import to_device
from birkhoff.kernels import use_fused

SAMPLE = 0  # draw tags within a step
DRAFT = 0  # DRAFT + k for the draft of depth k = 1..MAX_DRAFTS
ACCEPT = 32  # ACCEPT + j for the acceptance test of draft j = 1..MAX_DRAFTS
MAX_DRAFTS = 31
TAGS = 64  # tags per position
_M64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 value with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: Tensor) -> Tensor:
    """The splitmix64 output function of an int64 state (bitwise as on uint64)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def splitmix64_reference(x: int) -> int:
    """Pure-Python splitmix64 on uint64 (the test reference of `splitmix64`)."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class RequestRandom:
    """Uniforms for rows that belong to requests with their own keys.

    `keys_R` holds one int64 key per cache row (set when a request takes the row);
    `uniform(rows, positions, tags)` returns fp64 uniforms in [0, 1), one per element of the
    broadcast of its three arguments; with fused kernels (`kernels`, the engine's kernel choice)
    one Triton launch computes the same bits (kernels/rng.py).
    """

    def __init__(self, num_rows: int, device: torch.device, kernels: str = "eager") -> None:
        self.keys_R = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.device, self.kernels = device, kernels

    @staticmethod
    def request_key(seed: int, request: int) -> int:
        """The key of request `request` of a call seeded with `seed` (as int64 bits)."""
        state = splitmix64_reference(seed & _M64)
        return _signed(splitmix64_reference(state ^ request))

    def assign(self, rows: list[int], keys: list[int]) -> None:
        """Give each row in `rows` its request's key (one queued copy, no host sync)."""
        self.keys_R[to_device(rows, self.device)] = to_device(keys, self.device)

    def uniform(self, rows: Tensor, positions: Tensor, tags: int | Tensor) -> Tensor:
        assert isinstance(tags, Tensor) or 0 <= tags < TAGS, tags
        counter = positions.long() * TAGS + tags
        key = self.keys_R[rows]
        if use_fused(key, self.kernels):  # the same bits in one launch (kernels/rng.py)
            from birkhoff.kernels.rng import splitmix_uniform

            return splitmix_uniform(*torch.broadcast_tensors(key, counter))
        bits = splitmix64(key ^ counter)  # keys are random: one mix suffices
        return _shr(bits, 11).double() * 2.0**-53  # 53 random bits -> [0, 1) exactly
