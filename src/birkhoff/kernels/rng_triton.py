"""Triton kernel of the engine's counter-based uniforms (engine/rng.py): splitmix64 in one launch.

Legend: N draws.

The eager version is ~20 int64 elementwise kernels per draw (xor, adds, multiplies, shifts
emulated as arithmetic shift + mask); a decode step draws several times, and at decode sizes
each of those kernels costs its launch, not its bytes. Here the same bits come from uint64
arithmetic (wrapping multiplies, logical shifts) in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def splitmix_uniform(key_ptr, counter_ptr, out_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    key = tl.load(key_ptr + i, mask=ok, other=0)
    counter = tl.load(counter_ptr + i, mask=ok, other=0)
    tl.store(out_ptr + i, uniform_bits(key, counter), mask=ok)
