"""Refit of MoE models: stacked experts in buckets (spanning them), experts named when lost."""

from __future__ import annotations

import pytest
import torch
from refit_helpers import bit_equal, make_engine, make_model, pack_buckets, run, tiny_config

from birkhoff.config import MoEConfig
from birkhoff.engine import Engine
from birkhoff.model.moe import MoEFeedForward, update_router_bias
from birkhoff.refit import RefitError, RefitSession, refit
from birkhoff.refit.bucket import place
from birkhoff.refit.pack import manifest_key, refit_layout

MOE = MoEConfig(num_experts=6, experts_per_token=2, expert_hidden=16)
CFG = tiny_config(moe=MOE)  # layer 0 dense, layer 1 and both MTP depths MoE
STACK = "layers.1.mlp.experts.w_down"  # [6, 32, 16] fp32: 2048 bytes per expert


def moe_model(seed: int) -> torch.nn.Module:
    model = make_model(CFG, seed)
    gen = torch.Generator().manual_seed(seed)
    for layer in model.modules():
        if isinstance(layer, MoEFeedForward):
            layer.router_bias.copy_(torch.randn(6, generator=gen) * 0.05)
    return model


MODEL_A, MODEL_B = moe_model(0), moe_model(1)


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("bucket_bytes", [700, 5000, 1 << 20])
def test_moe_refit_equals_a_fresh_engine(quantize: str | None, bucket_bytes: int) -> None:
    engine = make_engine(MODEL_A, quantize=quantize)
    report = refit(MODEL_B, engine, bucket_bytes=bucket_bytes, quantize=quantize)
    assert report.version == engine.weight_version == 1
    assert bit_equal(engine.weights, make_engine(MODEL_B, quantize=quantize).weights)
    layout = refit_layout(CFG, manifest_key(engine.manifest()), bucket_bytes)
    buckets_of_stack = [i for i, b in enumerate(layout.buckets)
                        if any(e.name == STACK for e in b.entries)]  # fmt: skip
    spec = engine.manifest()[STACK]
    nbytes = spec.dtype.itemsize * 6 * 32 * 16
    # larger than a bucket: chunks in buckets of its own, an expert may span two of them
    expected = -(-nbytes // bucket_bytes) if nbytes > bucket_bytes else 1
    assert len(buckets_of_stack) == expected


def test_router_bias_update_reaches_the_engine_by_name() -> None:
    model = moe_model(2)
    engine = make_engine(model)
    layer = model.blocks[1].mlp
    assert isinstance(layer, MoEFeedForward)
    with torch.no_grad():
        model.train()(torch.randint(0, 64, (2, 8)))
    update_router_bias(model)
    model.eval()
    assert not torch.equal(engine.weights["layers.1.mlp.router_bias"], layer.router_bias)
    refit(model, engine, bucket_bytes=4096)
    assert torch.equal(engine.weights["layers.1.mlp.router_bias"], layer.router_bias)
    assert engine.weights["layers.1.mlp.router_bias"].dtype == torch.float32


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("bucket_bytes", [3000, 4096])
def test_a_lost_bucket_names_exactly_the_experts_it_carried(
    quantize: str | None, bucket_bytes: int
) -> None:
    engine = make_engine(MODEL_A, quantize=quantize)
    before = run(engine)
    served = list(make_engine(MODEL_B, quantize=quantize).weights.items())
    buckets = list(pack_buckets(served, bucket_bytes))
    name = "mtp.0.block.mlp.experts.w_gate_up" if quantize else STACK
    lost = next(b for b in buckets if any(e.name == name and e.chunk_offset > 0 for e in b.entries))
    (entry,) = [e for e in lost.entries if e.name == name]
    per_expert = entry.total_nbytes // entry.shape[0]
    lo, hi = entry.chunk_offset, entry.chunk_offset + entry.nbytes
    experts = range(lo // per_expert, -(-hi // per_expert))
    session = RefitSession(engine)
    session.begin()
    for bucket in buckets:
        if bucket is not lost:
            session.load_bucket(bucket)
    with pytest.raises(RefitError) as info:
        session.finish()
    others = sorted(e.name for e in lost.entries if e.name != name)  # whatever else it carried
    expected = [f"{name} expert {e}" for e in experts]
    assert set(expected) <= set(info.value.incomplete) and len(expected) < MOE.num_experts
    assert sorted(set(info.value.incomplete) - set(expected)) == sorted(
        n for n in others if n not in info.value.missing
    )
    assert f"{name} expert {experts[0]}" in str(info.value)
    assert engine.weight_version == 0 and run(engine) == before  # nothing committed
    refit(MODEL_B, engine, bucket_bytes=bucket_bytes, quantize=quantize)
    assert bit_equal(engine.weights, dict(served))


def test_a_missing_stack_and_a_missing_router_bias_are_named() -> None:
    engine = make_engine(MODEL_A)
    served = [(n, t) for n, t in make_engine(MODEL_B).weights.items()
              if n not in (STACK, "mtp.1.block.mlp.router_bias")]  # fmt: skip
    session = RefitSession(engine)
    session.begin()
    for bucket in pack_buckets(served, 4096):
        session.load_bucket(bucket)
    with pytest.raises(RefitError) as info:
        session.finish()
    assert info.value.missing == ["layers.1.mlp.experts.w_down", "mtp.1.block.mlp.router_bias"]
    assert not info.value.incomplete and engine.weight_version == 0


def test_stack_chunks_are_placed_at_element_boundaries() -> None:
    specs = [[(STACK, torch.float32, (6, 32, 16))]]
    entries = [e for bucket in place(specs, 3000) for e in bucket]
    assert sum(e.nbytes for e in entries) == 6 * 32 * 16 * 4
    assert all(e.nbytes % 4 == 0 and e.chunk_offset % 4 == 0 for e in entries)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_cuda_moe_refit_equals_a_fresh_engine_and_the_cpu_codes(quantize: str | None) -> None:
    """On CUDA fp8 stacks go through the fused kernel ([E*r, c] or expert by expert): the same
    bits as the CPU reference; a refit equals a fresh CUDA engine."""
    cfg = tiny_config(moe=MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=96),
                      dim=256, num_heads=4)  # fmt: skip
    model_a, model_b = make_model(cfg, 0), make_model(cfg, 1)
    kw = dict(device="cuda", dtype=torch.bfloat16, quantize=quantize, max_batch_size=3)
    engine = Engine.from_model(model_a.cuda(), **kw)  # type: ignore[arg-type]
    refit(model_b.cuda(), engine, bucket_bytes=1 << 16, quantize=quantize)
    fresh = Engine.from_model(model_b, **kw)  # type: ignore[arg-type]
    assert bit_equal({n: t.cpu() for n, t in engine.weights.items()},
                     {n: t.cpu() for n, t in fresh.weights.items()})  # fmt: skip
    if quantize:
        cpu = make_engine(model_b.cpu(), quantize="fp8")
        for name in ("layers.1.mlp.experts.w_gate_up", "layers.1.mlp.experts.w_down"):
            for part in (
                name,
                name + "_scale_inv",
            ):  # rows 192: expert by expert; rows 256: one [E*r, c] call
                got, want = engine.weights[part].cpu(), cpu.weights[part]
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), part
