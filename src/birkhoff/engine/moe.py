"""The engine's MoE feed-forward: the trainer's `moe_ffn` on weights read by name.

Legend: A active rows, T tokens of one chunk, D model dim.

Routing and expert math are `birkhoff.model.moe.moe_ffn`, the function the trainer's
`MoEFeedForward` calls, so the engine routes every token exactly as the trainer does (same
sigmoid scores in >= fp32, same biased top-k, same gate normalisation); an fp32 engine differs
from the trainer only by matmul rounding. Routing is per token (no capacity limit, nothing
dropped), so padded slots of a chunk change no real token's experts. Experts run through the
grouped GEMMs on CUDA and the exact loop elsewhere (`pick_expert_fn`). fp8 expert stacks are
dequantized to the activation dtype before the matmuls (`engine.linear.weight`), like every
other fp8 weight. Left out: dequantizing only the selected experts, fp8 grouped GEMMs.
"""

from __future__ import annotations

from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.linear import weight
from birkhoff.model.moe import moe_ffn


def moe_mlp(x_ATD: Tensor, w: dict[str, Tensor], prefix: str, cfg: ModelConfig) -> Tensor:
    """Output [A,T,D] of the MoE feed-forward whose weights are `prefix + "mlp.*"`."""
    assert cfg.moe is not None, "an MoE layer in a config without moe"
    A, T, D = x_ATD.shape
    mlp, dtype = prefix + "mlp.", x_ATD.dtype
    shared = None
    if cfg.moe.num_shared_experts:
        shared = (
            weight(w, mlp + "shared.w_gate_up", dtype),
            weight(w, mlp + "shared.w_down", dtype),
        )
    y_TD, _, _ = moe_ffn(
        x_ATD.reshape(A * T, D), w[mlp + "router.weight"], w[mlp + "router_bias"],
        weight(w, mlp + "experts.w_gate_up", dtype), weight(w, mlp + "experts.w_down", dtype),
        shared, moe=cfg.moe,
    )  # fmt: skip
    return y_TD.view(A, T, D)
