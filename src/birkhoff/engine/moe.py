"""The engine's MoE feed-forward: the trainer's `moe_ffn` on a block's `MoEWeights` record.

Legend: A active rows, T tokens of one chunk, D model dim.

Routing and expert math are `birkhoff.model.moe.moe_ffn`, the function the trainer's
`MoEFeedForward` calls, so the engine routes every token exactly as the trainer does; an fp32
engine differs from the trainer only by matmul rounding. Routing is per token (no capacity
limit), so padded slots of a chunk change no real token's experts. fp8 expert stacks are
dequantized to the activation dtype before the matmuls (`engine.linear.weight`).
Left out: dequantizing only the selected experts, fp8 grouped GEMMs.
"""

from __future__ import annotations

from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.layout import MoEWeights
from birkhoff.engine.linear import weight
from birkhoff.model.moe import moe_ffn


def moe_mlp(x_ATD: Tensor, mlp: MoEWeights[Tensor], cfg: ModelConfig) -> Tensor:
    """Output [A,T,D] of the MoE feed-forward `mlp`."""
    assert cfg.moe is not None, "an MoE layer in a config without moe"
    A, T, D = x_ATD.shape
    dtype = x_ATD.dtype
    shared = None
    if mlp.shared_gate_up is not None and mlp.shared_down is not None:
        shared = (weight(mlp.shared_gate_up, dtype), weight(mlp.shared_down, dtype))
    y_TD, _, _ = moe_ffn(
        x_ATD.reshape(A * T, D),
        mlp.router,
        mlp.router_bias,
        weight(mlp.experts_gate_up, dtype),
        weight(mlp.experts_down, dtype),
        shared,
        moe=cfg.moe,
    )
    return y_TD.view(A, T, D)
