"""The engine layout computed from the ModelConfig alone equals the one the trainer implies."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import tiny_config

from birkhoff.engine.layout import engine_parts, engine_shapes
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
    from birkhoff.engine.layout import build_manifest

    cfg = tiny_config(num_streams=4, mtp_depth=1, qkv_bias=True)
    manifest = build_manifest(cfg, dtype=torch.bfloat16, quantize=quantize)  # type: ignore[arg-type]
    mhc = {n for n in manifest if n.rsplit(".", 1)[-1] in ("phi", "alpha", "bias")
           and (".hc_" in n or "contraction." in n)}  # fmt: skip
    assert len(mhc) == 3 * (2 * cfg.num_layers + 1 + 3 * cfg.mtp_depth)
    assert all(manifest[n].dtype == torch.float32 for n in mhc)
    assert manifest["layers.0.attn.wqkv.bias"].dtype == torch.bfloat16
    assert manifest["layers.0.attn_norm.weight"].dtype == torch.bfloat16
