"""A custom op with a direct eager entry: `FusedOp`.

Every fused training op is a `torch.library` custom op with a fake impl and registered
autograd, so torch.compile traces it as one node and its backward is a custom op too. Outside
compiled code the custom-op dispatcher costs the host more than the kernels (a training step
issues ~140 such calls), so a `FusedOp` there calls the same implementation directly, inside a
`torch.autograd.Function` built from the same setup-context and backward when a gradient is
needed: one implementation and one backward, two entry points. The op is a
`torch.library.triton_op` (inductor launches its kernels from generated code); under the Triton
interpreter, where traced kernels cannot run on fake tensors, a plain `custom_op`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from birkhoff.kernels.common import INTERPRET, needs_grad

_direct = threading.local()  # .on: inside FusedOp's direct eager entry


def traceable(kernel: Any) -> Any:
    """`kernel` as an op implementation launches it: itself on FusedOp's direct eager entry
    and under the interpreter, else through `wrap_triton`, so that a tracer records the launch
    (wrap_triton's eager launch builds a higher-order-op call each time: slow on the host)."""
    if INTERPRET or getattr(_direct, "on", False):
        return kernel
    return torch.library.wrap_triton(kernel)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _traced(args: tuple[Any, ...]) -> bool:
    """Whether a tracer sees this call (a dispatch mode such as fake tensors or make_fx is on,
    or a tensor is a subclass such as a functional or fake tensor): the custom op then, as the
    tracer must see one node, not the kernels (AOT autograd traces a registered backward so)."""
    if _get_current_dispatch_mode() is not None:
        return True
    return any(isinstance(a, torch.Tensor) and type(a) not in _PLAIN for a in args)


class FusedOp:
    """`birkhoff::<name>` from `impl` (type-annotated; its kernels launched through
    `wrap_triton`) and its fake impl (used under the interpreter); call it like `impl`."""

    def __init__(self, name: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> None:
        self.impl, self.name = impl, name
        self.op: Any  # a torch.library CustomOpDef either way
        if INTERPRET:
            self.op = torch.library.custom_op(f"birkhoff::{name}", impl, mutates_args=())
            self.op.register_fake(fake)
        else:  # the fake impl is impl itself, traced (wrap_triton launches nothing on fakes)
            self.op = torch.library.triton_op(f"birkhoff::{name}", impl, mutates_args=())
        self.function: Any = None  # the eager autograd.Function, once autograd is registered

    def register_autograd(
        self, backward: Callable[..., Any], *, setup_context: Callable[..., None]
    ) -> None:
        """Register `backward` (and `setup_context(ctx, inputs, output)`) on the custom op, and
        build the eager autograd.Function from the same two functions."""
        self.op.register_autograd(backward, setup_context=setup_context)
        impl = self.impl

        def forward(ctx: Any, *args: Any) -> Any:
            out = impl(*args)
            setup_context(ctx, args, out)
            return out

        def function_backward(ctx: Any, *grads: Any) -> Any:
            return backward(ctx, *grads)

        name = "".join(part.title() for part in self.name.split("_"))  # mhc_mix_out: MhcMixOut
        self.function = type(
            name,
            (torch.autograd.Function,),
            {"forward": staticmethod(forward), "backward": staticmethod(function_backward)},
        )

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling() or _traced(args):
            return self.op(*args)
        outer, _direct.on = getattr(_direct, "on", False), True
        try:
            if self.function is not None and needs_grad(*args):
                return self.function.apply(*args)
            return self.impl(*args)
        finally:
            _direct.on = outer
