"""The engine's MoE feed-forward on a block's `MoEWeights` record: gather-and-gemv for a few
token rows, the trainer's `moe_ffn` otherwise.

Legend: A active rows, T tokens, X token rows (A*T flattened), D model dim, R experts per token.

A few rows (decode, verify and draft chunks of small batches; `kernels.moe_gemv.serves`) with
fused kernels on take `kernels.moe_gemv`: one routing launch, then one launch that reads only
the picked experts' gate_up rows (and the shared experts') and one for their down rows and the
gated sum, fp8 codes decoded in registers: a routed expert costs what a dense gemv of its size
does. Everything else goes through `birkhoff.model.moe.moe_ffn`, the function the trainer's
`MoEFeedForward` calls (grouped GEMMs on CUDA), so the engine routes every token exactly as the
trainer does (V4's hash layers: the experts of each token id); fp8 expert stacks are
dequantized first (`engine.linear.weight`). Routing is per token (no capacity limit), so padded
slots change no real token's experts. Both paths equal the trainer's math up to rounding.
"""

from __future__ import annotations

from torch import Tensor

from birkhoff.config import ModelConfig
from birkhoff.engine.layout import Linear, MoEWeights
from birkhoff.engine.linear import weight
from birkhoff.kernels import moe_gemv, use_fused
from birkhoff.model.moe import moe_ffn


def moe_mlp(
    x_ATD: Tensor,
    mlp: MoEWeights[Tensor],
    cfg: ModelConfig,
    *,
    kernels: str = "eager",
    tokens_AT: Tensor | None = None,
) -> Tensor:
    """Output [A,T,D] of the MoE feed-forward `mlp`; a hash layer (`mlp.tid2eid`) takes the
    experts of the token ids `tokens_AT`."""
    assert cfg.moe is not None, "an MoE layer in a config without moe"
    A, T, D = x_ATD.shape
    x_XD = x_ATD.reshape(A * T, D)
    expert_ids_XR = None
    if mlp.tid2eid is not None:
        assert tokens_AT is not None, "a hash-routed MoE layer needs the chunk's token ids"
        expert_ids_XR = mlp.tid2eid[tokens_AT.reshape(-1)]
    fused = use_fused(x_ATD, kernels) and expert_ids_XR is None
    if fused and moe_gemv.serves(A * T) and _gatherable(mlp):
        return gather_gemv(x_XD, mlp, cfg).view(A, T, D)
    dtype = x_ATD.dtype
    shared = None
    if mlp.shared_gate_up is not None and mlp.shared_down is not None:
        shared = (weight(mlp.shared_gate_up, dtype), weight(mlp.shared_down, dtype))
    y_XD, _, _ = moe_ffn(
        x_XD,
        mlp.router,
        mlp.router_bias,
        weight(mlp.experts_gate_up, dtype),
        weight(mlp.experts_down, dtype),
        shared,
        moe=cfg.moe,
        expert_ids_TR=expert_ids_XR,
    )
    return y_XD.view(A, T, D)


def _matmuls(mlp: MoEWeights[Tensor]) -> list[Linear[Tensor]]:
    shared = [lin for lin in (mlp.shared_gate_up, mlp.shared_down) if lin is not None]
    return [mlp.experts_gate_up, mlp.experts_down, *shared]


def _gatherable(mlp: MoEWeights[Tensor]) -> bool:
    """Every matmul weight block-fp8, or none (the kernels take one format a call)."""
    return len({lin.scale_inv is None for lin in _matmuls(mlp)}) == 1


def gather_gemv(x_XD: Tensor, mlp: MoEWeights[Tensor], cfg: ModelConfig) -> Tensor:
    """The fused few-row path: route, then the picked experts' SwiGLUs and the shared one [X,D]."""
    assert cfg.moe is not None
    expert_ids, gates = moe_gemv.moe_route(
        x_XD, mlp.router, mlp.router_bias, cfg.moe.experts_per_token, cfg.moe.route_scale
    )
    scales = [lin.scale_inv for lin in _matmuls(mlp) if lin.scale_inv is not None]
    shared_gate_up, shared_down = mlp.shared_gate_up, mlp.shared_down
    return moe_gemv.moe_experts(  # type: ignore[no-any-return]
        x_XD,
        expert_ids,
        gates,
        mlp.experts_gate_up.weight,
        mlp.experts_down.weight,
        scales,
        None if shared_gate_up is None else shared_gate_up.weight,
        None if shared_down is None else shared_down.weight,
    )
