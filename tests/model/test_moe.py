"""MoE feed-forward: routing math, balancing, expert paths, recompute and the census, training."""

from __future__ import annotations

import json

import pytest
import torch
from torch import Tensor

from birkhoff.config import ModelConfig, MoEConfig
from birkhoff.model import Transformer
from birkhoff.model.layers import SwiGLU
from birkhoff.model.moe import (
    MoEFeedForward,
    expert_load_stats,
    experts_grouped,
    experts_loop,
    pick_expert_fn,
    router_scores,
    select_experts,
    sequence_balance_loss,
    update_router_bias,
)
from birkhoff.recompute import census, checkpoint, sanitize, track_saved_storages
from birkhoff.train.config import ReclaimMode
from birkhoff.train.recompute import apply_recompute

MOE = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=16)
CFG = ModelConfig(
    vocab_size=64, dim=32, num_layers=2, num_heads=4, num_streams=4, max_seq_len=16, moe=MOE
)


def moe_layer(moe: MoEConfig = MOE, seed: int = 0) -> MoEFeedForward:
    torch.manual_seed(seed)
    return MoEFeedForward(CFG.replace(moe=moe), moe).double()


def randn(*shape: int, seed: int = 1) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# ---- routing math


def test_routing_matches_a_per_token_reference() -> None:
    layer = moe_layer()
    layer.router_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x_BTD = randn(2, 5, 32)
    out_BTD = layer(x_BTD)
    w_r, b = layer.router.weight, layer.router_bias
    for bi in range(2):
        for t in range(5):
            x = x_BTD[bi, t]
            s = [float(torch.sigmoid(w_r[e] @ x).detach()) for e in range(4)]
            chosen = sorted(range(4), key=lambda e: -(s[e] + float(b[e])))[:2]
            ref = torch.zeros(32, dtype=torch.float64)
            for e in chosen:
                gate = s[e] / sum(s[c] for c in chosen)
                w_gu, w_d = layer.experts.w_gate_up[e], layer.experts.w_down[e]
                g, u = (w_gu @ x).chunk(2)
                ref = ref + gate * (w_d @ (torch.nn.functional.silu(g) * u))
            g, u = (layer.shared.w_gate_up @ x).chunk(2)  # type: ignore[union-attr]
            ref = ref + layer.shared.w_down @ (torch.nn.functional.silu(g) * u)  # type: ignore[union-attr]
            torch.testing.assert_close(out_BTD[bi, t], ref, rtol=1e-12, atol=1e-12)


def test_topk_selection_and_gate_normalisation() -> None:
    scores_TE = torch.sigmoid(randn(50, 8))
    bias_E = torch.zeros(8, dtype=torch.float64)
    idx_TR, gates_TR = select_experts(scores_TE, bias_E, 3)
    torch.testing.assert_close(gates_TR.sum(-1), torch.ones(50, dtype=torch.float64))
    assert torch.equal(idx_TR.sort(-1).values, scores_TE.topk(3).indices.sort(-1).values)
    torch.testing.assert_close(
        gates_TR, scores_TE.gather(-1, idx_TR) / scores_TE.topk(3).values.sum(-1, keepdim=True)
    )


def test_bias_changes_selection_but_not_gate_weights() -> None:
    scores_TE = torch.sigmoid(randn(40, 4))
    plain_idx, _ = select_experts(scores_TE, torch.zeros(4, dtype=torch.float64), 2)
    bias_E = torch.tensor([0.0, 0.0, 0.0, 5.0], dtype=torch.float64)  # expert 3 always chosen
    idx_TR, gates_TR = select_experts(scores_TE, bias_E, 2)
    assert (idx_TR == 3).any(-1).all() and not torch.equal(idx_TR, plain_idx)
    picked_TR = scores_TE.gather(-1, idx_TR)
    torch.testing.assert_close(gates_TR, picked_TR / picked_TR.sum(-1, keepdim=True))


def test_bias_update_moves_load_toward_balance() -> None:
    moe = MoEConfig(num_experts=4, experts_per_token=1, expert_hidden=16, bias_update_rate=0.005)
    layer = moe_layer(moe)
    with torch.no_grad():
        layer.router.weight[0] += 1.0  # expert 0 takes about half of the tokens at first
    x_BTD = randn(8, 32, 32)
    ratios = []
    for _ in range(100):
        layer(x_BTD)
        ratios.append(expert_load_stats(layer)[""]["max_over_mean"])
        update_router_bias(layer)
    assert layer.expert_load.sum() == 256
    # sign updates of a fixed step oscillate around balance; on average they stay close to it
    assert ratios[0] > 1.9 and sum(ratios[-20:]) / 20 < 1.3
    fresh = moe_layer(moe)
    fresh(x_BTD)  # zero bias: selection is the plain top-k, nothing rerouted
    assert expert_load_stats(fresh)[""]["rerouted_fraction"] == 0.0
    assert layer.router_bias[0] < 0  # the overloaded expert's bias went down
    stats = expert_load_stats(layer)[""]
    assert 0 < stats["rerouted_fraction"] <= 1  # the bias now sends some tokens elsewhere
    assert stats["mean_load"] == 64 and stats["max_load"] == float(layer.expert_load.max())


def test_balance_loss_gradient_equals_the_plain_gradient_of_loss_plus_aux() -> None:
    w = 0.05
    moe = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=16, balance_loss_weight=w)
    x_BTD = randn(2, 6, 32).requires_grad_()
    injected, plain = moe_layer(moe), moe_layer(moe)
    (injected(x_BTD) ** 2).sum().backward()
    grad_x = x_BTD.grad.clone()  # type: ignore[union-attr]
    x_BTD.grad = None
    out_BTD, aux = plain.route_and_compute(x_BTD)
    ((out_BTD**2).sum() + w * aux).backward()
    assert torch.equal(grad_x, x_BTD.grad)  # type: ignore[arg-type]
    for (name, p), q in zip(injected.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name  # type: ignore[arg-type]
    assert injected.router.weight.grad.abs().sum() > 0  # type: ignore[union-attr]
    assert float(injected.balance_loss) == pytest.approx(float(aux.detach()))


def test_sequence_balance_loss_by_hand() -> None:
    scores_BTE = torch.sigmoid(randn(2, 3, 4))
    idx_BTR = scores_BTE.topk(2).indices
    total = 0.0
    for b in range(2):
        p = (scores_BTE[b] / scores_BTE[b].sum(-1, keepdim=True)).mean(0)
        f = torch.tensor(
            [int((idx_BTR[b] == e).sum()) * 4 / (2 * 3) for e in range(4)], dtype=torch.float64
        )
        total += float((f * p).sum()) / 2
    assert float(sequence_balance_loss(scores_BTE, idx_BTR)) == pytest.approx(total, rel=1e-12)


# ---- expert paths


def expert_inputs(dtype: torch.dtype, device: str = "cpu") -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    x_TD = torch.randn(40, 32, generator=g, dtype=torch.float64)
    scores_TE = torch.sigmoid(torch.randn(40, 8, generator=g, dtype=torch.float64))
    scores_TE[:, 5] = 0.0  # expert 5 gets no token: an empty group
    idx_TR, gates_TR = select_experts(scores_TE, torch.zeros(8, dtype=torch.float64), 2)
    w_gate_up = torch.randn(8, 32, 32, generator=g, dtype=torch.float64) * 0.1
    w_down = torch.randn(8, 32, 16, generator=g, dtype=torch.float64) * 0.1
    tensors = (x_TD, w_gate_up, w_down)
    x_TD, w_gate_up, w_down = (t.to(device, dtype).requires_grad_() for t in tensors)
    return x_TD, idx_TR.to(device), gates_TR.to(device, dtype), w_gate_up, w_down


def run_experts(fn: object, inputs: tuple[Tensor, ...]) -> list[Tensor]:
    x_TD, idx_TR, gates_TR, w_gate_up, w_down = inputs
    out_TD = fn(x_TD, idx_TR, gates_TR, w_gate_up, w_down)  # type: ignore[operator]
    (out_TD.float() ** 2).sum().backward()
    return [out_TD.detach(), x_TD.grad, w_gate_up.grad, w_down.grad]  # type: ignore[list-item]


def test_grouped_experts_match_the_loop_on_cpu() -> None:
    """grouped_mm runs on CPU in fp32: the no-loop path against the fp64 loop and the fp32 one."""
    exact = run_experts(experts_loop, expert_inputs(torch.float64))
    loop32 = run_experts(experts_loop, expert_inputs(torch.float32))
    grouped = run_experts(experts_grouped, expert_inputs(torch.float32))
    for ref, a, b in zip(exact, loop32, grouped, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.double(), ref, rtol=1e-4, atol=1e-5)
    assert exact[3][5].abs().sum() == 0  # the empty expert gets no gradient


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_the_loop_on_cuda(dtype: torch.dtype) -> None:
    exact = run_experts(experts_loop, expert_inputs(torch.float64))
    grouped = run_experts(experts_grouped, expert_inputs(dtype, "cuda"))
    frac = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for ref, got in zip(exact, grouped, strict=True):
        assert_close_to_scale(got, ref, frac)


def assert_close_to_scale(got: Tensor, ref: Tensor, frac: float) -> None:
    """max |got - ref| <= frac * max |ref| (elementwise tolerances mean little for bf16)."""
    got, ref = got.detach().double().cpu(), ref.detach()
    err, scale = float((got - ref).abs().max()), float(ref.abs().max())
    assert scale > 0 and err <= frac * scale, (err, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_layer_on_cuda_under_bf16_autocast_takes_the_grouped_path() -> None:
    moe = MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=16, balance_loss_weight=0.01)
    ref_layer = moe_layer(moe)
    layer = moe_layer(moe).float().cuda()
    x_BTD = randn(2, 24, 32)
    x_cuda = x_BTD.float().cuda()
    w_gate_up, w_down = layer.experts.w_gate_up.bfloat16(), layer.experts.w_down.bfloat16()
    assert pick_expert_fn(x_cuda.bfloat16().flatten(0, 1), w_gate_up, w_down) is experts_grouped
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x_cuda)
    out.float().square().sum().backward()
    ref_layer(x_BTD).square().sum().backward()
    assert_close_to_scale(out, ref_layer(x_BTD).detach(), 3e-2)
    for (name, p), q in zip(layer.named_parameters(), ref_layer.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert_close_to_scale(p.grad, q.grad, 3e-2)
    assert torch.equal(layer.expert_load.cpu().double(), ref_layer.expert_load)


# ---- recompute, reclaim and the census


def train_loss_and_grads(
    cfg: ModelConfig, reclaim: ReclaimMode | None = None
) -> tuple[Tensor, dict[str, Tensor], dict]:
    """One fp64 forward/backward; `reclaim` set: every block and MTP depth under full recompute."""
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    if reclaim is not None:
        apply_recompute(model, reclaim=reclaim)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with track_saved_storages():
        out = model(ids, labels=ids)
    out.loss.backward()
    loss = out.loss.detach().clone()  # a copy: the forward's loss storage must die with `out`
    del out
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss, grads, {"census": census().live_bytes, "load": expert_load_stats(model)}


@pytest.mark.parametrize("balance_loss_weight", [0.0, 0.01])
def test_moe_under_safe_recompute_is_identical_and_leaks_nothing(
    balance_loss_weight: float,
) -> None:
    moe = MoEConfig(
        num_experts=4,
        experts_per_token=2,
        expert_hidden=16,
        balance_loss_weight=balance_loss_weight,
    )
    cfg = CFG.replace(moe=moe, mtp_depth=1)
    ref_loss, ref_grads, ref_info = train_loss_and_grads(cfg)
    with sanitize():
        loss, grads, info = train_loss_and_grads(cfg, reclaim="safe")
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and any("experts" in n for n in grads)
    for name, g in ref_grads.items():
        assert g is not None and torch.equal(grads[name], g), name
    assert info["census"] == 0 and ref_info["census"] == 0
    assert info["load"] == ref_info["load"]  # the rerun overwrote the load, it did not add
    assert {s["mean_load"] for s in info["load"].values()} == {2 * 12 * 2 / 4}


class StashingMoE(MoEFeedForward):
    """The historic pattern: the router's scores of the (recomputed) forward kept on `self`."""

    def route_and_compute(
        self, x_BTD: Tensor, input_ids_BT: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        self.stash = router_scores(x_BTD.flatten(0, 1), self.router.weight)  # keeps its graph
        return super().route_and_compute(x_BTD, input_ids_BT)


def accumulate_grad_leaves(t: Tensor) -> list[Tensor]:
    """The leaf tensors that t's graph ends in (what its AccumulateGrad nodes hold)."""
    leaves, todo, seen = [], [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        todo.extend(n for n, _ in node.next_functions)
    return leaves


def run_stashing_layer(wrap: object) -> tuple[StashingMoE, Tensor]:
    """One checkpointed forward + backward of a StashingMoE; (layer, the scores it should stash)."""
    torch.manual_seed(0)
    layer = StashingMoE(CFG, MOE).double()
    inp = randn(2, 8, 32).requires_grad_()
    with track_saved_storages():
        h_BTD = inp * 2.0  # the checkpoint input: 2*8*32 fp64 = 4096 bytes, a forward activation
        out = wrap(layer, h_BTD)  # type: ignore[operator]
        loss = (out**2).sum()
    with torch.no_grad():  # outside the tracked forward: not in the census
        expected_scores = router_scores(h_BTD.flatten(0, 1), layer.router.weight)
    loss.backward()
    return layer, expected_scores


def test_the_historic_leak_reproduced_with_a_reentrant_checkpoint() -> None:
    """torch's reentrant checkpoint (megatron's CheckpointFunction is built the same way): the
    stash from the rerun keeps its graph, which ends in the rerun's detached copy of the input,
    an AccumulateGrad leaf that keeps the input's storage and its gradient alive."""
    layer, expected = run_stashing_layer(
        lambda f, x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True)
    )
    (leaf,) = [v for v in accumulate_grad_leaves(layer.stash) if v.dim() == 3]
    assert leaf.untyped_storage().nbytes() == 4096 and leaf.grad is not None
    assert leaf.grad.untyped_storage().nbytes() == 4096
    report = census(model=layer)
    assert report.live_bytes == 4096 and report.holders == {"stash": 16 * 4 * 8}
    assert torch.equal(layer.stash.detach(), expected)


@pytest.mark.parametrize("reclaim", ["never", "safe"])
def test_the_historic_leak_is_cured_by_our_checkpoint(reclaim: str) -> None:
    """The rerun's graph ends at a 0-byte anchor, not at a leaf of the input: the stash keeps only
    itself (the census names it as a holder), the input storage dies with backward."""
    layer, expected = run_stashing_layer(lambda f, x: checkpoint(f, x, reclaim=reclaim, name="moe"))
    leaves = accumulate_grad_leaves(layer.stash)
    assert not any(v.dim() == 3 for v in leaves)  # no leaf on the input's storage
    assert all(v is layer.router.weight or v.untyped_storage().nbytes() == 0 for v in leaves)
    report = census(model=layer)
    assert report.live_bytes == 0 and report.pending_storages == 0
    assert report.holders == {"stash": 16 * 4 * 8}  # reported, never freed: the layer holds it
    assert torch.equal(layer.stash.detach(), expected)


# ---- whole model, placement, config


def test_transformer_with_moe_trains() -> None:
    torch.manual_seed(0)
    cfg = CFG.replace(mtp_depth=1)
    model = apply_recompute(Transformer(cfg), reclaim="safe")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, cfg.vocab_size, (4, 12), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(8):
        with track_saved_storages():
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        update_router_bias(model)
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0]
    assert set(expert_load_stats(model)) == {"layers.1.mlp", "mtp.0.block.mlp"}
    assert any(
        m.router_bias.abs().sum() > 0 for m in model.modules() if isinstance(m, MoEFeedForward)
    )


@pytest.mark.parametrize(("dense", "mtp_moe"), [(0, True), (1, False), (2, True)])
def test_moe_placement(dense: int, mtp_moe: bool) -> None:
    moe = MoEConfig(
        num_experts=4,
        experts_per_token=2,
        expert_hidden=16,
        num_dense_layers=dense,
        mtp_moe=mtp_moe,
    )
    model = Transformer(CFG.replace(moe=moe, mtp_depth=1))
    kinds = [type(b.mlp) for b in model.blocks] + [type(d.block.mlp) for d in model.mtp_depths]
    expected = [SwiGLU] * dense + [MoEFeedForward] * (2 - dense)
    assert kinds == expected + [MoEFeedForward if mtp_moe else SwiGLU]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_experts", 0),
        ("experts_per_token", 5),
        ("experts_per_token", 0),
        ("expert_hidden", 0),
        ("num_shared_experts", -1),
        ("num_dense_layers", -1),
        ("mtp_moe", 1),
        ("route_scale", 0.0),
        ("bias_update_rate", float("nan")),
        ("balance_loss_weight", -0.1),
    ],
)
def test_invalid_moe_field_names_field_and_value(field: str, value: object) -> None:
    kwargs = {"num_experts": 4, "experts_per_token": 2, "expert_hidden": 16, field: value}
    with pytest.raises(ValueError, match=field) as err:
        MoEConfig(**kwargs)  # type: ignore[arg-type]
    assert repr(value) in str(err.value)


def test_moe_config_round_trips_and_is_checked_against_the_model() -> None:
    cfg = CFG.replace(
        moe=MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=16, mtp_moe=False)
    )
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    assert ModelConfig.from_dict(json.loads(CFG.replace(moe=None).to_json())).moe is None
    with pytest.raises(ValueError, match="unknown field"):
        ModelConfig.from_dict({**json.loads(cfg.to_json()), "moe": {"num_experts": 8, "colour": 1}})
    too_many = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=16, num_dense_layers=3)
    with pytest.raises(ValueError, match="moe.num_dense_layers=3"):
        Transformer(CFG.replace(moe=too_many))
