"""FusedOp: the direct eager entry and the registered custom op give the same values and
gradients (a toy op on CPU; the fused mHC ops are checked the same way in the interpreter)."""

from __future__ import annotations

import torch
from torch import Tensor

from birkhoff.kernels.fused_op import FusedOp


def _scale_impl(x: Tensor, factor: float) -> Tensor:
    return x * factor


def _scale_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.factor = inputs[1]


def _scale_backward(ctx, g):  # type: ignore[no-untyped-def]
    return g * ctx.factor, None


SCALE = FusedOp("test_ops_scale", _scale_impl, lambda x, factor: torch.empty_like(x))
SCALE.register_autograd(_scale_backward, setup_context=_scale_setup)


def test_eager_entry_and_custom_op_agree() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    y = SCALE(x, 2.5)
    assert type(y.grad_fn).__name__ == "TestOpsScaleBackward"  # the eager autograd.Function
    (g,) = torch.autograd.grad(y.square().sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: SCALE(t, 2.5), backend="aot_eager", fullgraph=True)
    y_op = compiled(x)
    (g_op,) = torch.autograd.grad(y_op.square().sum(), x)
    torch.testing.assert_close(y_op, y, rtol=0, atol=0)
    torch.testing.assert_close(g_op, g, rtol=0, atol=0)
    torch.testing.assert_close(g, 2 * 2.5 * 2.5 * x.detach())
    with torch.no_grad():
        assert SCALE(x, 2.0).grad_fn is None  # no gradient needed: the implementation alone
    torch.library.opcheck(torch.ops.birkhoff.test_ops_scale.default, (x.detach(), 2.0))
