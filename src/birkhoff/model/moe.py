"""Mixture-of-experts feed-forward: DeepSeek-V3 routing and balancing, and DeepSeek-V4's variants.

Legend: B batch, T tokens, D model dim, E experts, F expert hidden (2F: gate and up rows fused),
R experts per token, Q routed (token, expert) pairs = B*T*R, V vocab.

Affinities s = score(x W_r^T) (V3 sigmoid; V4 sqrt(softplus) or softmax), top-R selection on s +
a per-expert bias buffer (moved after each optimizer step by `update_router_bias`), gates
normalised over the selected experts, plus shared experts. V4's hash layers pick the R experts by
token id from a fixed table (`HashMoEFeedForward`); V4's experts clamp their SwiGLU inputs. The
optional balance loss (sequence-wise, or V4's Switch form) reaches the gradient through
`_BalanceLossGrad`. Experts are stored stacked ([E, 2F, D], [E, D, F]); `experts_loop` (CPU,
reference) and `experts_grouped` (grouped GEMMs on CUDA) compute the same outputs. docs/moe.md.
Left out: capacity limits and token dropping, node-limited group routing, expert parallelism.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from birkhoff.config import ModelConfig, MoEConfig, check
from birkhoff.model.layers import SwiGLU, _compute_dtype

ExpertFn = Callable[..., Tensor]  # (x [T,D], ids [T,R], gates [T,R], w_gate_up, w_down, *, act)
GateAct = Callable[[Tensor, Tensor], Tensor]  # (gate [*,F], up [*,F]) -> [*,F]


def _sqrt_softplus(logits: Tensor) -> Tensor:
    return F.softplus(logits).sqrt()


def _softmax(logits: Tensor) -> Tensor:
    return torch.softmax(logits, dim=-1)


# MoEConfig.scoring -> the affinity of the router logits [T,E]
SCORE_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "sigmoid": torch.sigmoid,
    "softmax": _softmax,
    "sqrtsoftplus": _sqrt_softplus,
}


def router_logits(x_TD: Tensor, weight_ED: Tensor) -> Tensor:
    """Router logits [T,E], computed in >= fp32 with autocast off."""
    dtype = _compute_dtype(x_TD.dtype)
    with torch.autocast(x_TD.device.type, enabled=False):
        return F.linear(x_TD.to(dtype), weight_ED.to(dtype))


def router_scores(x_TD: Tensor, weight_ED: Tensor, scoring: str = "sigmoid") -> Tensor:
    """Affinities s [T,E] = score(router logits), in >= fp32 with autocast off."""
    return SCORE_FNS[scoring](router_logits(x_TD, weight_ED))


def selected_gates(scores_TE: Tensor, idx_TR: Tensor) -> Tensor:
    """Gates [T,R]: the selected affinities normalised to sum 1 (+1e-20, as V3 and V4 do)."""
    picked_TR = scores_TE.gather(-1, idx_TR)
    return picked_TR / (picked_TR.sum(-1, keepdim=True) + 1e-20)


def select_experts(scores_TE: Tensor, bias_E: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(expert ids [T,R], gates [T,R]): top-k of scores + bias; gates from the scores alone."""
    idx_TR = torch.topk(scores_TE + bias_E.to(scores_TE.dtype), k, dim=-1).indices
    return idx_TR, selected_gates(scores_TE, idx_TR)


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


def switch_balance_loss(
    logits: Sequence[Tensor], num_experts: int, top_k: int, mask_BT: Tensor | None = None
) -> Tensor:
    """DeepSeek-V4's (transformers' Switch-Transformer) balance loss over the layers' router
    logits [B*T, E]: E * sum_e f_e P_e, f_e = share of top-k picks of softmax(logits) going to e
    (times k), P_e = mean softmax probability of e, both pooled over the layers (and masked-in
    tokens of `mask_BT`) before the product. f carries no gradient."""
    picks_E = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    prob_E = torch.zeros_like(picks_E)
    rows = picks_E.new_zeros(())
    for logits_QE in logits:
        w_Q = torch.ones(logits_QE.shape[0], device=picks_E.device)
        if mask_BT is not None:
            w_Q = mask_BT.reshape(-1).to(picks_E)
        probs_QE = torch.softmax(logits_QE, dim=-1)
        idx_QR = torch.topk(probs_QE, top_k, dim=-1).indices
        picks_E = picks_E.scatter_add(0, idx_QR.reshape(-1), w_Q.repeat_interleave(top_k))
        prob_E = prob_E + (probs_QE.float() * w_Q[:, None]).sum(0)
        rows = rows + w_Q.sum()
    return num_experts * ((picks_E / rows) * (prob_E / rows)).sum()


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


def silu_mul(gate_TF: Tensor, up_TF: Tensor) -> Tensor:
    """SwiGLU's activation silu(gate) * up."""
    return F.silu(gate_TF) * up_TF


def clamped_silu_mul(gate_TF: Tensor, up_TF: Tensor, *, limit: float) -> Tensor:
    """DeepSeek-V4's expert activation: silu(min(gate, l)) * clamp(up, -l, l)."""
    return F.silu(gate_TF.clamp(max=limit)) * up_TF.clamp(min=-limit, max=limit)


def gate_act(moe: MoEConfig) -> GateAct:
    """The experts' activation of `moe`: clamped (V4's `swiglu_limit`) or plain."""
    if moe.swiglu_limit is None:
        return silu_mul
    return functools.partial(clamped_silu_mul, limit=moe.swiglu_limit)


def swiglu(
    x_TD: Tensor, w_gate_up_2FD: Tensor, w_down_DF: Tensor, *, act: GateAct = silu_mul
) -> Tensor:
    """One fused-layout SwiGLU: w_gate_up = [gate rows; up rows] ([2F, D]), w_down [D, F]."""
    gate_TF, up_TF = F.linear(x_TD, w_gate_up_2FD).chunk(2, dim=-1)
    return F.linear(act(gate_TF, up_TF), w_down_DF)


def _combine(y_QD: Tensor, gates_TR: Tensor) -> Tensor:
    """Sum the R slot outputs of each token, weighted by its gates: [T*R, D] -> [T, D].

    In the gates' precision (>= fp32), cast back after: bf16 expert outputs are not summed in bf16.
    """
    T, R = gates_TR.shape
    dtype = torch.promote_types(y_QD.dtype, gates_TR.dtype)
    y_TRD = y_QD.view(T, R, -1).to(dtype)
    return (y_TRD * gates_TR.to(dtype)[..., None]).sum(1).to(y_QD.dtype)


def experts_loop(
    x_TD: Tensor,
    idx_TR: Tensor,
    gates_TR: Tensor,
    w_gate_up_E2FD: Tensor,
    w_down_EDF: Tensor,
    *,
    act: GateAct = silu_mul,
) -> Tensor:
    """Reference expert computation: one SwiGLU per expert over the pairs routed to it."""
    R = idx_TR.shape[1]
    flat_Q = idx_TR.flatten()
    rows, outs = [], []
    for e in range(w_gate_up_E2FD.shape[0]):
        rows_e = (flat_Q == e).nonzero().squeeze(1)
        if rows_e.numel() > 0:
            rows.append(rows_e)
            outs.append(swiglu(x_TD[rows_e // R], w_gate_up_E2FD[e], w_down_EDF[e], act=act))
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
    x_TD: Tensor,
    idx_TR: Tensor,
    gates_TR: Tensor,
    w_gate_up_E2FD: Tensor,
    w_down_EDF: Tensor,
    *,
    act: GateAct = silu_mul,
) -> Tensor:
    """Expert computation without a loop: sort pairs by expert, two grouped GEMMs, un-sort."""
    E, R = w_gate_up_E2FD.shape[0], idx_TR.shape[1]
    flat_Q = idx_TR.flatten()
    order_Q = torch.argsort(flat_Q, stable=True)  # pair positions grouped by expert
    offs_E = count_load(idx_TR, E).cumsum(0).to(torch.int32)  # end of each expert's rows
    mm = _grouped_mm()
    x_QD = x_TD[order_Q // R]
    gate_QF, up_QF = mm(x_QD, w_gate_up_E2FD.transpose(-2, -1), offs=offs_E).chunk(2, dim=-1)
    y_QD = mm(act(gate_QF, up_QF), w_down_EDF.transpose(-2, -1), offs=offs_E)
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
    router_bias_E: Tensor | None,
    w_gate_up_E2FD: Tensor,
    w_down_EDF: Tensor,
    shared: tuple[Tensor, Tensor] | None,
    *,
    moe: MoEConfig,
    expert_ids_TR: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(output [T,D], router logits [T,E], expert ids [T,R]) of one MoE feed-forward.

    The one routing + expert computation of the trainer and the engine: routing in >= fp32 from
    `x_TD`, experts (and `shared` = (w_gate_up, w_down), if any) in the dtype of the expert weights.
    The experts are top-R of scores + `router_bias_E`, or `expert_ids_TR` where given (V4's hash
    layers: the table's ids, no bias); the gates come from the scores either way.
    """
    logits_TE = router_logits(x_TD, router_weight_ED)
    scores_TE = SCORE_FNS[moe.scoring](logits_TE)
    if expert_ids_TR is None:
        assert router_bias_E is not None, "top-k routing needs the router bias"
        idx_TR, gates_TR = select_experts(scores_TE, router_bias_E, moe.experts_per_token)
    else:
        idx_TR, gates_TR = expert_ids_TR, selected_gates(scores_TE, expert_ids_TR)
    xc_TD = x_TD.to(w_gate_up_E2FD.dtype)
    act = gate_act(moe)
    expert_fn = pick_expert_fn(xc_TD, w_gate_up_E2FD, w_down_EDF)
    gates_TR = gates_TR * moe.route_scale
    y_TD = expert_fn(xc_TD, idx_TR, gates_TR, w_gate_up_E2FD, w_down_EDF, act=act)
    if shared is not None:
        y_TD = y_TD + swiglu(xc_TD, *shared, act=act)
    return y_TD, logits_TE, idx_TR


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


def _sequence_loss(logits_BTE: Tensor, idx_BTR: Tensor, moe: MoEConfig) -> Tensor:
    return sequence_balance_loss(SCORE_FNS[moe.scoring](logits_BTE), idx_BTR)


def _switch_loss(logits_BTE: Tensor, idx_BTR: Tensor, moe: MoEConfig) -> Tensor:
    logits_QE = logits_BTE.flatten(0, 1)
    return switch_balance_loss([logits_QE], moe.num_experts, moe.experts_per_token)


# MoEConfig.balance_loss -> the balance loss of one layer's routing
BALANCE_FNS: dict[str, Callable[[Tensor, Tensor, MoEConfig], Tensor]] = {
    "sequence": _sequence_loss,
    "switch": _switch_loss,
}


class RoutedFeedForward(nn.Module):
    """Shared experts + R of E routed experts; records load and balance loss in buffers.

    Subclasses say how the R experts are picked: `MoEFeedForward` (top-R of the scores + a
    bias) and `HashMoEFeedForward` (a token-id table, V4's first layers).
    """

    takes_token_ids = True  # called as mlp(x_BTD, input_ids_BT) by the block
    expert_load: Tensor  # [E] tokens per expert in the last training forward
    balance_loss: Tensor  # [] the last training forward's balance loss, detached
    rerouted: Tensor  # [] fraction of its tokens whose experts the bias changed

    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        E = moe.num_experts
        self.router = nn.Linear(cfg.dim, E, bias=False)
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

    def selection(self, input_ids_BT: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """(selection bias [E], fixed expert ids [B*T,R]): how this layer picks its experts."""
        raise NotImplementedError

    def layer_balance_loss(self, logits_BTE: Tensor, idx_BTR: Tensor) -> Tensor:
        """This layer's balance loss, with its graph."""
        return BALANCE_FNS[self.moe.balance_loss](logits_BTE, idx_BTR, self.moe)

    def route_and_compute(
        self, x_BTD: Tensor, input_ids_BT: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(output [B,T,D], balance loss with its graph); also records the load when training."""
        B, T, D = x_BTD.shape
        dtype = _matmul_dtype(x_BTD)
        shared = None
        if self.shared is not None:
            shared = (self.shared.w_gate_up.to(dtype), self.shared.w_down.to(dtype))
        bias_E, ids_TR = self.selection(input_ids_BT)
        y_TD, logits_TE, idx_TR = moe_ffn(
            x_BTD.reshape(B * T, D),
            self.router.weight,
            bias_E,
            self.experts.w_gate_up.to(dtype),
            self.experts.w_down.to(dtype),
            shared,
            moe=self.moe,
            expert_ids_TR=ids_TR,
        )
        aux = self.layer_balance_loss(logits_TE.view(B, T, -1), idx_TR.view(B, T, -1))
        if self.training:
            self.record(logits_TE, idx_TR, aux)
        return y_TD.view(B, T, D), aux

    @torch.no_grad()
    def record(self, logits_TE: Tensor, idx_TR: Tensor, aux: Tensor) -> None:
        """Overwrite (never accumulate) the statistics of the last training forward, in place."""
        self.expert_load.copy_(count_load(idx_TR, self.moe.num_experts))
        self.balance_loss.copy_(aux)
        self.rerouted.copy_(self.rerouted_by_bias(logits_TE, idx_TR))

    def rerouted_by_bias(self, logits_TE: Tensor, idx_TR: Tensor) -> Tensor:
        return rerouted_fraction(SCORE_FNS[self.moe.scoring](logits_TE), idx_TR)

    def forward(self, x_BTD: Tensor, input_ids_BT: Tensor | None = None) -> Tensor:
        out_BTD, aux = self.route_and_compute(x_BTD, input_ids_BT)
        weight = self.moe.balance_loss_weight
        if weight > 0 and torch.is_grad_enabled() and aux.requires_grad:
            out_BTD = _BalanceLossGrad.apply(out_BTD, aux, weight)
        return out_BTD


class MoEFeedForward(RoutedFeedForward):
    """Top-R routing on the scores + a per-expert bias (DeepSeek-V3, V4's later layers)."""

    router_bias: Tensor  # [E] selection bias, fp32, persistent (checkpoints, refit)

    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__(cfg, moe)
        self.register_buffer("router_bias", torch.zeros(moe.num_experts))

    def selection(self, input_ids_BT: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        return self.router_bias, None


def default_hash_table(vocab_size: int, num_experts: int, k: int) -> Tensor:
    """tid2eid [V,R]: token v visits experts (v*R + r) mod E, r < R: R distinct, even load."""
    return (torch.arange(vocab_size)[:, None] * k + torch.arange(k)) % num_experts


class HashMoEFeedForward(RoutedFeedForward):
    """DeepSeek-V4's hash-routed MoE: token v's experts are `tid2eid[v]`, a fixed table (a
    persistent buffer: checkpoints carry it); the router only weights them. No selection bias
    and no balance loss: nothing learned decides the load."""

    tid2eid: Tensor  # [V,R] int64 expert ids per token id

    def __init__(self, cfg: ModelConfig, moe: MoEConfig) -> None:
        super().__init__(cfg, moe)
        k = moe.experts_per_token
        self.register_buffer("tid2eid", default_hash_table(cfg.vocab_size, moe.num_experts, k))

    def selection(self, input_ids_BT: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        if input_ids_BT is None:
            raise ValueError("a hash-routed MoE layer needs the token ids: pass input_ids_BT")
        return None, self.tid2eid[input_ids_BT.reshape(-1)]

    def layer_balance_loss(self, logits_BTE: Tensor, idx_BTR: Tensor) -> Tensor:
        return logits_BTE.new_zeros(())

    def rerouted_by_bias(self, logits_TE: Tensor, idx_TR: Tensor) -> Tensor:
        return logits_TE.new_zeros(())


def is_moe_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether Block `index` (0..L-1 main layers, L + k for MTP depth k) uses MoE."""
    if cfg.moe is None:
        return False
    if index < cfg.num_layers:
        return index >= cfg.moe.num_dense_layers
    return cfg.moe.mtp_moe


def is_hash_layer(cfg: ModelConfig, index: int) -> bool:
    """Whether Block `index` is one of the first `num_hash_layers` MoE layers (never MTP)."""
    if cfg.moe is None or index >= cfg.num_layers:
        return False
    dense = cfg.moe.num_dense_layers
    return dense <= index < dense + cfg.moe.num_hash_layers


def build_feed_forward(cfg: ModelConfig, index: int) -> SwiGLU | RoutedFeedForward:
    """The feed-forward of Block `index`: dense SwiGLU, hash-routed or top-R MoE."""
    moe = cfg.moe
    if moe is None:
        return SwiGLU(cfg)
    check(isinstance(moe, MoEConfig), "moe", moe, "must be a MoEConfig or None")
    dense = moe.num_dense_layers
    check(dense <= cfg.num_layers, "moe.num_dense_layers", dense, f"> num_layers={cfg.num_layers}")
    hashed = moe.num_hash_layers
    room = cfg.num_layers - dense
    check(hashed <= room, "moe.num_hash_layers", hashed, f"> num_layers - num_dense={room}")
    if is_hash_layer(cfg, index):
        return HashMoEFeedForward(cfg, moe)
    return MoEFeedForward(cfg, moe) if is_moe_layer(cfg, index) else SwiGLU(cfg)


def moe_layers(model: nn.Module) -> list[tuple[str, RoutedFeedForward]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedFeedForward)]


@torch.no_grad()
def update_router_bias(model: nn.Module) -> None:
    """b_e -= gamma * sign(load_e - mean load) for every top-R MoE layer (after the optimizer
    step); hash-routed layers have no bias."""
    for _, layer in moe_layers(model):
        if not isinstance(layer, MoEFeedForward):
            continue
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
