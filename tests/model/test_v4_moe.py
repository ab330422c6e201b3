"""DeepSeek-V4 MoE: hash and top-k routing, clamped experts, balance loss vs transformers."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from birkhoff.config import ModelConfig, MoEConfig
from birkhoff.model import Transformer
from birkhoff.model.moe import (
    HashMoEFeedForward,
    MoEFeedForward,
    RoutedFeedForward,
    build_feed_forward,
    default_hash_table,
    switch_balance_loss,
    update_router_bias,
)
from birkhoff.train.recompute import apply_recompute

v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

D, E, R, F, V = 16, 6, 2, 8, 32


def hf_config(scoring: str = "sqrtsoftplus", limit: float = 0.7) -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=V,
        hidden_size=D,
        moe_intermediate_size=F,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=8,
        q_lora_rank=8,
        o_lora_rank=8,
        o_groups=1,
        n_routed_experts=E,
        num_experts_per_tok=R,
        scoring_func=scoring,
        routed_scaling_factor=1.5,
        swiglu_limit=limit,
        mlp_layer_types=["hash_moe", "moe"],
    )


def birkhoff_moe(scoring: str = "sqrtsoftplus", limit: float | None = 0.7) -> MoEConfig:
    return MoEConfig(
        num_experts=E,
        experts_per_token=R,
        expert_hidden=F,
        num_shared_experts=1,
        num_dense_layers=0,
        num_hash_layers=1,
        route_scale=1.5,
        scoring=scoring,  # type: ignore[arg-type]
        swiglu_limit=limit,
    )


def model_cfg(moe: MoEConfig) -> ModelConfig:
    return ModelConfig(vocab_size=V, dim=D, num_layers=2, num_heads=2, max_seq_len=16, moe=moe)


def copy_from_hf(layer: RoutedFeedForward, block: torch.nn.Module) -> None:
    """transformers' DeepseekV4SparseMoeBlock weights -> birkhoff's layer (the import mapping)."""
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.w_gate_up.copy_(block.experts.gate_up_proj)
        layer.experts.w_down.copy_(block.experts.down_proj)
        se = block.shared_experts
        assert layer.shared is not None
        layer.shared.w_gate_up.copy_(torch.cat([se.gate_proj.weight, se.up_proj.weight]))
        layer.shared.w_down.copy_(se.down_proj.weight)
        if isinstance(layer, HashMoEFeedForward):
            layer.tid2eid.copy_(block.gate.tid2eid)
        else:
            assert isinstance(layer, MoEFeedForward)
            layer.router_bias.copy_(block.gate.e_score_correction_bias)


def pair(scoring: str, index: int, *, seed: int = 0) -> tuple[torch.nn.Module, RoutedFeedForward]:
    """(transformers' block of layer `index`, birkhoff's layer with the same weights), fp64."""
    torch.manual_seed(seed)
    # transformers' ACT2FN has no "softmax" (its config names it): patched onto its router
    block = v4.DeepseekV4SparseMoeBlock(hf_config(scoring.replace("softmax", "sigmoid")), index)
    block = block.double()
    if scoring == "softmax":
        block.gate.score_fn = torch.nn.Softmax(dim=-1)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    if index == 0:
        block.gate.tid2eid.copy_(torch.stack([torch.randperm(E)[:R] for _ in range(V)]))
    else:
        block.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
    layer = build_feed_forward(model_cfg(birkhoff_moe(scoring)), index).double()
    copy_from_hf(layer, block)
    return block, layer


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax", "sigmoid"])
@pytest.mark.parametrize("index", [0, 1], ids=["hash", "topk"])
def test_v4_moe_block_matches_transformers_outputs_and_gradients(scoring: str, index: int) -> None:
    block, layer = pair(scoring, index)
    assert isinstance(layer, HashMoEFeedForward if index == 0 else MoEFeedForward)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, D, dtype=torch.float64, generator=g) * 2  # large: the clamp acts
    ids = torch.randint(0, V, (2, 7), generator=g)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = block(x_ref, input_ids=ids)
    ours = layer(x_ours, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-13, atol=1e-13)
    w = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    (ref * w).sum().backward()
    (ours * w).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    se = block.shared_experts
    pairs = [
        (layer.router.weight, block.gate.weight),
        (layer.experts.w_gate_up, block.experts.gate_up_proj),
        (layer.experts.w_down, block.experts.down_proj),
        (layer.shared.w_gate_up, torch.cat([se.gate_proj.weight, se.up_proj.weight])),  # type: ignore[union-attr]
        (layer.shared.w_down, se.down_proj.weight),  # type: ignore[union-attr]
    ]
    for ours_p, ref_p in pairs[:3] + pairs[4:]:
        torch.testing.assert_close(ours_p.grad, ref_p.grad, rtol=1e-12, atol=1e-12)
    ref_gu = torch.cat([se.gate_proj.weight.grad, se.up_proj.weight.grad])
    torch.testing.assert_close(layer.shared.w_gate_up.grad, ref_gu, rtol=1e-12, atol=1e-12)  # type: ignore[union-attr]


def test_the_clamp_is_active_and_matches_the_reference_activation() -> None:
    block, layer = pair("sqrtsoftplus", 1)
    gate_up = torch.linspace(-3, 3, 2 * F, dtype=torch.float64)[None]
    from birkhoff.model.moe import gate_act

    gate, up = gate_up.chunk(2, dim=-1)
    ours = gate_act(layer.moe)(gate, up)
    torch.testing.assert_close(ours, block.experts._apply_gate(gate_up), rtol=0, atol=0)
    plain = gate_act(birkhoff_moe(limit=None))(gate, up)
    assert not torch.equal(ours, plain)


def test_hash_layer_routes_by_token_id_only() -> None:
    _, layer = pair("sqrtsoftplus", 0)
    x = torch.randn(1, 4, D, dtype=torch.float64)
    ids = torch.tensor([[3, 3, 5, 3]])
    layer.train()
    layer(x, ids)
    expected = torch.zeros(E)
    for t in ids.flatten().tolist():
        expected[layer.tid2eid[t]] += 1
    assert torch.equal(layer.expert_load, expected)
    with pytest.raises(ValueError, match="needs the token ids"):
        layer(x)


def test_default_hash_table_gives_distinct_experts_and_even_load() -> None:
    table = default_hash_table(60, 6, 3)
    assert all(len(set(row.tolist())) == 3 for row in table)
    assert torch.equal(torch.bincount(table.flatten(), minlength=6), torch.full((6,), 30))


def test_switch_balance_loss_matches_transformers() -> None:
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(10, E, dtype=torch.float64, generator=g) for _ in range(3))
    ref = v4.load_balancing_loss_func(logits, E, R)
    torch.testing.assert_close(switch_balance_loss(logits, E, R), ref, rtol=0, atol=0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    ref_masked = v4.load_balancing_loss_func(logits, E, R, mask)
    ours = switch_balance_loss(logits, E, R, mask)
    torch.testing.assert_close(ours, ref_masked, rtol=1e-6, atol=0)


def test_switch_balance_loss_reaches_the_gradient() -> None:
    moe = MoEConfig(
        num_experts=E,
        experts_per_token=R,
        expert_hidden=F,
        balance_loss="switch",
        balance_loss_weight=0.1,
        scoring="sqrtsoftplus",
    )
    torch.manual_seed(0)
    layer = MoEFeedForward(model_cfg(moe), moe).double()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    layer(x).sum().backward()
    with_loss = layer.router.weight.grad.clone()  # type: ignore[union-attr]
    layer.router.weight.grad = None
    out, aux = layer.route_and_compute(x)
    ref = v4.load_balancing_loss_func((layer.router(x.flatten(0, 1)),), E, R)
    torch.testing.assert_close(aux, ref, rtol=0, atol=0)
    (out.sum() + 0.1 * aux).backward()
    torch.testing.assert_close(with_loss, layer.router.weight.grad, rtol=1e-6, atol=1e-9)


def test_bias_update_moves_top_k_layers_and_skips_hash_layers() -> None:
    torch.manual_seed(0)
    model = Transformer(model_cfg(birkhoff_moe()).replace(num_streams=2, mtp_depth=1)).double()
    hash_layer, topk_layer = model.blocks[0].mlp, model.blocks[1].mlp
    assert isinstance(hash_layer, HashMoEFeedForward) and isinstance(topk_layer, MoEFeedForward)
    assert isinstance(model.mtp_depths[0].block.mlp, MoEFeedForward)  # MTP depths: top-k
    assert "router_bias" not in dict(hash_layer.named_buffers())
    ids = torch.randint(0, V, (2, 8))
    model.train()
    model(ids, labels=ids).loss.backward()  # type: ignore[union-attr]
    update_router_bias(model)
    assert topk_layer.router_bias.abs().sum() > 0
    assert hash_layer.expert_load.sum() == 2 * 8 * R


def test_hash_routed_model_under_safe_recompute_is_identical() -> None:
    cfg = model_cfg(birkhoff_moe()).replace(num_streams=2, mtp_depth=1)
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = Transformer(cfg).double()
        if recompute:
            apply_recompute(model, reclaim="safe")
        loss = model(ids, labels=ids).loss
        loss.backward()  # type: ignore[union-attr]
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_v4_moe_config_round_trips_and_rejects_bad_values() -> None:
    moe = MoEConfig(**{**_fields(birkhoff_moe()), "balance_loss": "switch"})
    cfg = model_cfg(moe)
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    for field, value in (
        ("scoring", "relu"),
        ("swiglu_limit", 0.0),
        ("num_hash_layers", -1),
        ("balance_loss", "global"),
    ):
        with pytest.raises(ValueError, match=field):
            MoEConfig(**{**_fields(moe), field: value})
    with pytest.raises(ValueError, match="num_hash_layers"):
        Transformer(model_cfg(MoEConfig(**{**_fields(moe), "num_hash_layers": 3})))


def _fields(moe: MoEConfig) -> dict[str, Any]:
    return {name: getattr(moe, name) for name in MoEConfig.__dataclass_fields__}
