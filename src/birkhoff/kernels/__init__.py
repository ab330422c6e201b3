"""Fused GPU ops (Triton) with their eager references and autograd wrappers.

`use_fused(x, kernels)` is the one switch every dispatching function of `birkhoff.model` reads:
"auto" runs a fused op on CUDA (not fp64), "eager" never, "triton" always (CPU tensors then need
the Triton interpreter, as the tests use it). `needs_grad` says whether autograd will want a
backward through some of a call's arguments.
"""

from __future__ import annotations

import importlib.util

import torch

KERNELS = ("auto", "eager", "triton")
TRITON = importlib.util.find_spec("triton") is not None


def use_fused(x: torch.Tensor, kernels: str) -> bool:
    """Whether to run the fused Triton ops: "triton" always, "auto" on CUDA (not fp64)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r} is invalid: must be one of {KERNELS}")
    if kernels == "auto":
        return TRITON and x.is_cuda and x.dtype != torch.float64
    return kernels == "triton"


def needs_grad(*values: object) -> bool:
    """Whether grad mode is on and some tensor among `values` requires a gradient."""
    return torch.is_grad_enabled() and any(
        isinstance(v, torch.Tensor) and v.requires_grad for v in values
    )
