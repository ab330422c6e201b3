"""Mixture-of-experts feed-forward with DeepSeek-V3 routing and auxiliary-loss-free balancing.

Legend: B batch, T tokens, D model dim, E experts, F expert hidden (2F: gate and up rows fused),
R experts per token, Q routed (token, expert) pairs = B*T*R.

Sigmoid affinities, top-R selection on affinity + a per-expert bias buffer (moved after each
optimizer step by `update_router_bias`), gates normalised over the selected experts, plus shared
experts. The optional sequence-wise balance loss reaches the gradient through `_BalanceLossGrad`.
Experts are stored stacked ([E, 2F, D], [E, D, F]); `experts_loop` (CPU, reference) and
`experts_grouped` (grouped GEMMs on CUDA) compute the same outputs. Details: docs/moe.md.
Left out: capacity limits and token dropping, node-limited group routing, expert parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from birkhoff.config import ModelConfig, MoEConfig, check
from birkhoff.model.layers import SwiGLU, _compute_dtype

ExpertFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def router_scores(x_TD: Tensor, weight_ED: Tensor) -> Tensor:
    """Sigmoid affinities s [T,E], computed in >= fp32 with autocast off."""
    dtype = _compute_dtype(x_TD.dtype)
    with torch.autocast(x_TD.device.type, enabled=False):
        return torch.sigmoid(F.linear(x_TD.to(dtype), weight_ED.to(dtype)))


def select_experts(scores_TE: Tensor, bias_E: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(expert ids [T,R], gates [T,R]): top-k of scores + bias; gates from the scores alone."""
    idx_TR = torch.topk(scores_TE + bias_E.to(scores_TE.dtype), k, dim=-1).indices
    picked_TR = scores_TE.gather(-1, idx_TR)
    return idx_TR, picked_TR / picked_TR.sum(-1, keepdim=True)


def count_load(idx_TR: Tensor, num_experts: int) -> Tensor:
    """Tokens routed to each expert [E] (int64), without a host sync."""
    flat_Q = idx_TR.flatten()
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=idx_TR.device)
    return counts_E.scatter_add_(0, flat_Q, torch.ones_like(flat_Q))


def rerouted_fraction(scores_TE: Tensor, idx_TR: Tensor) -> Tensor:
    """Fraction of tokens whose expert set the bias changed (top-k of the scores alone differs)."""
    plain_TR = torch.topk(scores_TE, idx_TR.shape[1], dim=-1).indices.sort(-1).values
    return (plain_TR != idx_TR.sort(-1).values).any(-1).float().mean()


def sequence_balance_loss(scores_BTE: Tensor, idx_BTR: Tensor) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss sum_e f_e P_e, averaged over sequences.

    f_e = E / (R T) * (tokens of the sequence routed to e), P_e = mean over the sequence of the
    affinities normalised over all experts. f carries no gradient.
    """
    B, T, E = scores_BTE.shape
    R = idx_BTR.shape[-1]
    hits_BE = torch.zeros(B, E, dtype=scores_BTE.dtype, device=scores_BTE.device)
    hits_BE.scatter_add_(
        1, idx_BTR.flatten(1), torch.ones_like(idx_BTR.flatten(1), dtype=hits_BE.dtype)
    )
    f_BE = hits_BE * (E / (R * T))
    p_BE = (scores_BTE / scores_BTE.sum(-1, keepdim=True)).mean(1)
    return (f_BE * p_BE).sum(-1).mean()


class _BalanceLossGrad(torch.autograd.Function):
    """Identity on `out`; backward also sends d(total)/d(aux) = weight into the aux graph."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, aux: Tensor, weight: float) -> Tensor:
        ctx.weight, ctx.aux_dtype = weight, aux.dtype  # metadata only: nothing saved
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, None]:
        aux_grad = torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=grad_out.device)
        return grad_out, aux_grad, None


def swiglu(x_TD: Tensor, w_gate_up_2FD: Tensor, w_down_DF: Tensor) -> Tensor:
    """One fused-layout SwiGLU: w_gate_up = [gate rows; up rows] ([2F, D]), w_down [D, F]."""
    gate_TF, up_TF = F.linear(x_TD, w_gate_up_2FD).chunk(2, dim=-1)
    return F.linear(F.silu(gate_TF) * up_TF, w_down_DF)


def _combine(y_QD: Tensor, gates_TR: Tensor) -> Tensor:
    """Sum the R slot outputs of each token, weighted by its gates: [T*R, D] -> [T, D].

    In the gates' precision (>= fp32), cast back after: bf16 expert outputs are not summed in bf16.
    """
    T, R = gates_TR.shape
    dtype = torch.promote_types(y_QD.dtype, gates_TR.dtype)
    y_TRD = y_QD.view(T, R, -1).to(dtype)
    return (y_TRD * gates_TR.to(dtype)[..., None]).sum(1).to(y_QD.dtype)


def experts_loop(
    x_TD: Tensor, idx_TR: Tensor, gates_TR: Tensor, w_gate_up_E2FD: Tensor, w_down_EDF: Tensor
) -> Tensor:
    """Reference expert computation: one SwiGLU per expert over the pairs routed to it."""
    R = idx_TR.shape[1]
    flat_Q = idx_TR.flatten()
    rows, outs = [], []
    for e in range(w_gate_up_E2FD.shape[0]):
        rows_e = (flat_Q == e).nonzero().squeeze(1)
        if rows_e.numel() > 0:
            rows.append(rows_e)
            outs.append(swiglu(x_TD[rows_e // R], w_gate_up_E2FD[e], w_down_EDF[e]))
    # outputs in expert order -> (token, slot) order
    y_QD = torch.cat(outs)[torch.argsort(torch.cat(rows))]
    return _combine(y_QD, gates_TR)


def _grouped_mm() -> Callable[..., Tensor]:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped_mm; use experts_loop")
    return fn  # type: ignore[no-any-return]


def grouped_mm_supported(x_TD: Tensor, w_gate_up_E2FD: Tensor, w_down_EDF: Tensor) -> bool:
    """grouped_mm's rules: one dtype of fp32/bf16/fp16, rows of D and F 16-byte aligned."""
    dtype = x_TD.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if w_gate_up_E2FD.dtype != dtype or w_down_EDF.dtype != dtype:
        return False
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    align = 16 // x_TD.element_size()
    return x_TD.shape[-1] % align == 0 and w_down_EDF.shape[-1] % align == 0


def experts_grouped(
    x_TD: Tensor, idx_TR: Tensor, gates_TR: Tensor, w_gate_up_E2FD: Tensor, w_down_EDF: Tensor
) -> Tensor:
    """Expert computation without a loop: sort pairs by expert, two grouped GEMMs, un-sort."""
    E, R = w_gate_up_E2FD.shape[0], idx_TR.shape[1]
    flat_Q = idx_TR.flatten()
    order_Q = torch.argsort(flat_Q, stable=True)  # pair positions grouped by expert
    offs_E = count_load(idx_TR, E).cumsum(0).to(torch.int32)  # end of each expert's rows
    mm = _grouped_mm()
    x_QD = x_TD[order_Q // R]
    gate_QF, up_QF = mm(x_QD, w_gate_up_E2FD.transpose(-2, -1), offs=offs_E).chunk(2, dim=-1)
    y_QD = mm(F.silu(gate_QF) * up_QF, w_down_EDF.transpose(-2, -1), offs=offs_E)
    inverse_Q = torch.empty_like(order_Q)
    inverse_Q[order_Q] = torch.arange(order_Q.numel(), device=order_Q.device)
    return _combine(y_QD[inverse_Q], gates_TR)


def pick_expert_fn(x_TD: Tensor, w_gate_up_E2FD: Tensor, w_down_EDF: Tensor) -> ExpertFn:
    """Grouped GEMMs on CUDA where supported; the exact loop elsewhere."""
    if x_TD.is_cuda and grouped_mm_supported(x_TD, w_gate_up_E2FD, w_down_EDF):
        return experts_grouped
    return experts_loop


def _matmul_dtype(x: Tensor) -> torch.dtype:
    """The dtype autocast would run a linear in (grouped_mm is not on autocast's lists)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def moe_ffn(
    x_TD: Tensor,
    router_weight_ED: Tensor,
    router_bias_E: Tensor,
    w_gate_up_E2FD: Tensor,
    w_down_EDF: Tensor,
    shared: tuple[Tensor, Tensor] | None,
    *,
    moe: MoEConfig,
) -> tuple[Tensor, Tensor, Tensor]:
    """(output [T,D], scores [T,E], expert ids [T,R]) of one MoE feed-forward.

    The one routing + expert computation of the trainer and the engine: routing in >= fp32 from
    `x_TD`, experts (and `shared` = (w_gate_up, w_down), if any) in the dtype of the expert weights.
    """
    scores_TE = router_scores(x_TD, router_weight_ED)
    idx_TR, gates_TR = select_experts(scores_TE, router_bias_E, moe.experts_per_token)
    xc_TD = x_TD.to(w_gate_up_E2FD.dtype)
    expert_fn = pick_expert_fn(xc_TD, w_gate_up_E2FD, w_down_EDF)
    y_TD = expert_fn(xc_TD, idx_TR, gates_TR * moe.route_scale, w_gate_up_E2FD, w_down_EDF)
    if shared is not None:
        y_TD = y_TD + swiglu(xc_TD, *shared)
    return y_TD, scores_TE, idx_TR


class StackedExperts(nn.Module):
    """E SwiGLU experts as two stacked tensors (engine layout, see the module docstring)."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, hidden))


class SharedExperts(nn.Module):
    """The shared experts as one SwiGLU in the fused layout: [2F', D] and [D, F']."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(2 * hidden, dim))
        self.w_down = nn.Parameter(torch.empty(dim, hidden))


class MoEFeedForward(nn.Module):
    """Shared experts + top-R routed experts; records load and balance loss in buffers."""

    router_bias: Tensor  # [E] selection bias, fp32, persistent (checkpoints, refit)
    expert_load: Tensor  # [E] tokens per expert in the last training forward
    balance_loss: Tensor  # [] the last training forward's balance loss, detached
    rerouted: Tensor  # [] fraction of its tokens whose experts the bias changed

    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        E = moe.num_experts
        self.router = nn.Linear(cfg.dim, E, bias=False)
        self.register_buffer("router_bias", torch.zeros(E))
        self.experts = StackedExperts(E, cfg.dim, moe.expert_hidden)
        self.shared: SharedExperts | None = None
        if moe.num_shared_experts > 0:
            self.shared = SharedExperts(cfg.dim, moe.num_shared_experts * moe.expert_hidden)
        # written in place by every training forward; not part of the state dict
        self.register_buffer("expert_load", torch.zeros(E), persistent=False)
        self.register_buffer("balance_loss", torch.zeros(()), persistent=False)
        self.register_buffer("rerouted", torch.zeros(()), persistent=False)
        self.reset_parameters(out_std=0.02 / math.sqrt(2 * (cfg.num_layers + cfg.mtp_depth)))

    def reset_parameters(self, *, out_std: float) -> None:
        """Normal(0, 0.02); the residual-output (down) projections use `out_std`."""
        nn.init.normal_(self.router.weight, std=0.02)
        for experts in (self.experts, self.shared):
            if experts is not None:
                nn.init.normal_(experts.w_gate_up, std=0.02)
                nn.init.normal_(experts.w_down, std=out_std)

    def route_and_compute(self, x_BTD: Tensor) -> tuple[Tensor, Tensor]:
        """(output [B,T,D], balance loss with its graph); also records the load when training."""
        B, T, D = x_BTD.shape
        dtype = _matmul_dtype(x_BTD)
        shared = None
        if self.shared is not None:
            shared = (self.shared.w_gate_up.to(dtype), self.shared.w_down.to(dtype))
        y_TD, scores_TE, idx_TR = moe_ffn(
            x_BTD.reshape(B * T, D),
            self.router.weight,
            self.router_bias,
            self.experts.w_gate_up.to(dtype),
            self.experts.w_down.to(dtype),
            shared,
            moe=self.moe,
        )
        aux = sequence_balance_loss(scores_TE.view(B, T, -1), idx_TR.view(B, T, -1))
        if self.training:
            self.record(scores_TE, idx_TR, aux)
        return y_TD.view(B, T, D), aux

    @torch.no_grad()
    def record(self, scores_TE: Tensor, idx_TR: Tensor, aux: Tensor) -> None:
        """Overwrite (never accumulate) the statistics of the last training forward, in place."""
        self.expert_load.copy_(count_load(idx_TR, self.moe.num_experts))
        self.balance_loss.copy_(aux)
        self.rerouted.copy_(rerouted_fraction(scores_TE, idx_TR))

    def forward(self, x_BTD: Tensor) -> Tensor:
        out_BTD, aux = self.route_and_compute(x_BTD)
        weight = self.moe.balance_loss_weight
        if weight > 0 and torch.is_grad_enabled():
            out_BTD = _BalanceLossGrad.apply(out_BTD, aux, weight)
        return out_BTD


def is_moe_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether Block `index` (0..L-1 main layers, L + k for MTP depth k) uses MoE."""
    if cfg.moe is None:
        return False
    if index < cfg.num_layers:
        return index >= cfg.moe.num_dense_layers
    return cfg.moe.mtp_moe


def build_feed_forward(cfg: ModelConfig, index: int) -> SwiGLU | MoEFeedForward:
    """The feed-forward of Block `index`: dense SwiGLU or MoE (see `is_moe_layer`)."""
    moe = cfg.moe
    if moe is None:
        return SwiGLU(cfg)
    check(isinstance(moe, MoEConfig), "moe", moe, "must be a MoEConfig or None")
    dense = moe.num_dense_layers
    check(dense <= cfg.num_layers, "moe.num_dense_layers", dense, f"> num_layers={cfg.num_layers}")
    return MoEFeedForward(cfg, moe) if is_moe_layer(cfg, index) else SwiGLU(cfg)


def moe_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoEFeedForward)]


@torch.no_grad()
def update_router_bias(model: nn.Module) -> None:
    """b_e -= gamma * sign(load_e - mean load) for every MoE layer (after the optimizer step)."""
    for _, layer in moe_layers(model):
        load_E = layer.expert_load
        layer.router_bias.sub_(
            layer.moe.bias_update_rate * torch.sign(load_E - load_E.mean()).to(layer.router_bias)
        )


@torch.no_grad()
def load_metrics(model: nn.Module) -> dict[str, float]:
    """The last training forward's load over all MoE layers, as flat metrics (none without MoE):
    moe_max_load (most tokens any expert of any layer got), moe_mean_load (tokens per expert),
    moe_max_over_mean (worst layer), moe_rerouted_fraction and moe_balance_loss (layer means).
    One host sync. No token is ever dropped (no capacity limit), so there is no dropped count."""
    layers = [layer for _, layer in moe_layers(model)]
    if not layers:
        return {}
    max_L = torch.stack([layer.expert_load.max() for layer in layers]).float()
    mean_L = torch.stack([layer.expert_load.mean() for layer in layers]).float()
    rerouted_L = torch.stack([layer.rerouted for layer in layers]).float()
    balance_L = torch.stack([layer.balance_loss for layer in layers]).float()
    ratio_L = max_L / mean_L.clamp(min=1e-12)
    figures = torch.stack(
        [max_L.max(), mean_L.mean(), ratio_L.max(), rerouted_L.mean(), balance_L.mean()]
    ).tolist()
    keys = (
        "moe_max_load",
        "moe_mean_load",
        "moe_max_over_mean",
        "moe_rerouted_fraction",
        "moe_balance_loss",
    )
    return dict(zip(keys, figures, strict=True))


def expert_load_stats(model: nn.Module) -> dict[str, dict[str, float]]:
    """Per MoE layer: max and mean tokens per expert, their ratio, the balance loss value and
    the fraction of tokens the bias rerouted (no token is ever dropped)."""
    stats = {}
    for name, layer in moe_layers(model):
        load_E = layer.expert_load
        mean = float(load_E.mean())
        stats[name] = {
            "max_load": float(load_E.max()),
            "mean_load": mean,
            "max_over_mean": float(load_E.max()) / mean if mean > 0 else 0.0,
            "balance_loss": float(layer.balance_loss),
            "rerouted_fraction": float(layer.rerouted),
        }
    return stats
