"""What every fused op shares: Triton (or a stand-in), the kernel switch, input checks, sizes.

Triton is optional: without it, `triton` and `tl` are stand-ins whose `jit` returns the function
unchanged, so kernel modules import Triton at the top of the file and define their kernels
everywhere; only a launch needs the real package (`use_fused` never picks one without it).
`use_fused(x, kernels)` is the switch every dispatching function reads: "auto" runs a fused op
on CUDA (not fp64), "eager" never, "triton" always (CPU tensors then need the Triton
interpreter, as the tests use it). `check_inputs` / `check_device` guard every op's entry.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor


def _stand_in() -> tuple[Any, Any]:
    """(triton, triton.language) stand-ins: decorators that return the function, and a `tl`
    whose attributes (dtypes, `constexpr`) are None."""

    def decorator(fn: Any = None, **_: Any) -> Any:
        return fn if callable(fn) else (lambda f: f)

    class Language(SimpleNamespace):
        def __getattr__(self, name: str) -> Any:
            return None

    return SimpleNamespace(jit=decorator, cdiv=lambda a, b: -(-a // b)), Language()


try:
    import triton
    import triton.language as tl

    TRITON = True
except ImportError:
    triton, tl = _stand_in()
    TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton does
KERNELS = ("auto", "eager", "triton")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_fused(x: Tensor, kernels: str) -> bool:
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


def check_device(*tensors: Tensor) -> None:
    """Raise ValueError unless these tensors live where the fused kernels run (CUDA, or any
    device under the Triton interpreter)."""
    for t in tensors:
        if not t.is_cuda and not INTERPRET:
            raise ValueError(f"kernels='triton': device={t.device} needs CUDA")


def check_inputs(*tensors: Tensor) -> None:
    """Raise ValueError unless the fused kernels can run on these tensors."""
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"kernels='triton': dtype={t.dtype} is not fp32/bf16/fp16")
        check_device(t)


def pow2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints."""
    return -(-a // b)
