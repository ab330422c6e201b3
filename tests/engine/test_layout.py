"""The engine layout computed from the ModelConfig alone equals the one the trainer implies."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import tiny_config

from birkhoff.config import MoEConfig
from birkhoff.engine.layout import build_manifest, engine_parts, engine_shapes, leaves, load_weights
from birkhoff.model import Transformer

FUSED = {
    "attn.wqkv.weight": ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight"),
    "mlp.w_gate_up.weight": ("mlp.w_gate.weight", "mlp.w_up.weight"),
    "attn.wqkv.bias": ("attn.wq.bias", "attn.wk.bias", "attn.wv.bias"),
}


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_embeddings": True}, {"num_streams": 1, "mtp_depth": 0},
     {"mtp_depth": 3, "num_kv_heads": 1}, {"num_kv_heads": 4, "mlp_hidden": 40},
     {"qkv_bias": True, "attn_out_bias": True, "qk_norm": True, "attn_head_dim": 6}],
)  # fmt: skip
def test_engine_parts_cover_every_trainer_parameter_once(overrides: dict[str, Any]) -> None:
    cfg = tiny_config(**overrides)
    with torch.device("meta"):
        model = Transformer(cfg)
    trainer = {n: tuple(p.shape) for n, p in model.named_parameters()}  # a tied lm_head once
    table = engine_parts(cfg)
    parts = [part for ps in table.values() for part in ps]
    assert sorted(name for name, _ in parts) == sorted(trainer)
    assert all(trainer[name] == shape for name, shape in parts)
    shapes = engine_shapes(cfg)
    for name, ps in table.items():
        suffix = next((s for s in FUSED if name.endswith(s)), None)
        prefix = name.removesuffix(suffix or "")
        expected = [prefix + p for p in FUSED[suffix]] if suffix else [name]
        assert [part for part, _ in ps] == expected
        assert shapes[name] == (sum(s[0] for _, s in ps), *ps[0][1][1:])


@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_mhc_coefficient_tensors_are_served_in_fp32(quantize: str | None) -> None:
    """phi, alpha and bias of every hyper-connection and contraction stay fp32 in a bf16 (or
    fp8) engine, as the trainer holds them; every other non-matmul tensor is bf16."""

    cfg = tiny_config(num_streams=4, mtp_depth=1, qkv_bias=True)
    manifest = build_manifest(cfg, dtype=torch.bfloat16, quantize=quantize)  # type: ignore[arg-type]
    mhc = {n for n in manifest if n.rsplit(".", 1)[-1] in ("phi", "alpha", "bias")
           and (".hc_" in n or "contraction." in n)}  # fmt: skip
    assert len(mhc) == 3 * (2 * cfg.num_layers + 1 + 3 * cfg.mtp_depth)
    assert all(manifest[n].dtype == torch.float32 for n in mhc)
    assert manifest["layers.0.attn.wqkv.bias"].dtype == torch.bfloat16
    assert manifest["layers.0.attn_norm.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_embeddings": True, "num_streams": 1}, {"mtp_depth": 0},
     {"qkv_bias": True, "attn_out_bias": True, "qk_norm": True},
     {"moe": MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=8)}],
)  # fmt: skip
def test_records_read_exactly_the_manifest(overrides: dict[str, Any], quantize: str | None) -> None:
    """The forward's typed records are built from the committed name -> tensor dict: every
    manifest name is read by some field (fp8 scales by their weight's record), none twice (a
    tied lm_head is the embedding), and every field holds the tensor of its name."""
    cfg = tiny_config(**overrides)
    manifest = build_manifest(cfg, dtype=torch.float32, quantize=quantize)  # type: ignore[arg-type]
    weights = {name: torch.empty(spec.shape, dtype=spec.dtype) for name, spec in manifest.items()}
    records = load_weights(cfg, weights)
    read = [id(t) for t in leaves(records)]
    by_id = {id(t): name for name, t in weights.items()}
    names = [by_id[i] for i in read]  # a KeyError: a field holds a tensor that is not served
    tied = names.count("embed.weight") - 1
    assert tied == int(cfg.tie_embeddings) and len(names) - tied == len(set(names))
    assert set(names) == set(manifest)
    assert len(records.layers) == cfg.num_layers and len(records.mtp) == cfg.mtp_depth
    if quantize:
        assert (
            records.layers[0].attn.qkv.scale_inv is weights["layers.0.attn.wqkv.weight_scale_inv"]
        )
    assert (records.layers[0].hc_attn is None) == (cfg.num_streams == 1)
