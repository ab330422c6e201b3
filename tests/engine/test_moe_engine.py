"""The engine's MoE layers against the trainer: layout, greedy tokens, drafts, fp8 expert blocks."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import tiny_config, train_briefly
from test_generate import RAGGED, naive_greedy

from birkhoff.config import MoEConfig
from birkhoff.engine import Engine, SamplingParams, TensorSpec
from birkhoff.engine.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise
from birkhoff.engine.layout import engine_parts, engine_shapes, matmul_weights
from birkhoff.model import Transformer
from birkhoff.model.moe import MoEFeedForward, expert_load_stats

MOE = MoEConfig(num_experts=6, experts_per_token=2, expert_hidden=16, num_dense_layers=1)


def moe_config(**overrides: object) -> object:
    return tiny_config(moe=MOE, **overrides)


@pytest.fixture(scope="module")
def moe_model() -> Transformer:
    """Two layers (dense, MoE), two MoE MTP depths, trained a little; a bias that reroutes."""
    model = train_briefly(tiny_config(moe=MOE, sinkhorn_iters=5), steps=30)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(5)
    for layer in model.modules():
        if isinstance(layer, MoEFeedForward):
            layer.router_bias.copy_(torch.randn(6, generator=gen) * 0.05)
    return model


def test_layout_serves_router_experts_and_shared_experts_of_moe_layers_only() -> None:
    cfg = tiny_config(moe=MOE, tie_embeddings=True)
    with torch.device("meta"):
        model = Transformer(cfg)
    trainer = {n: tuple(p.shape) for n, p in model.named_parameters()}
    trainer.update({n: tuple(b.shape) for n, b in model.named_buffers() if "router_bias" in n})
    parts = [part for ps in engine_parts(cfg).values() for part in ps]
    assert sorted(name for name, _ in parts) == sorted(trainer)
    assert all(trainer[name] == shape for name, shape in parts)
    shapes = engine_shapes(cfg)
    assert shapes["layers.1.mlp.experts.w_gate_up"] == (6, 32, 32)
    assert shapes["mtp.1.block.mlp.experts.w_down"] == (6, 32, 16)
    assert shapes["layers.1.mlp.shared.w_gate_up"] == (32, 32)
    assert "layers.0.mlp.w_gate_up.weight" in shapes and "layers.0.mlp.router.weight" not in shapes
    no_mtp_moe = tiny_config(moe=MoEConfig(num_experts=4, experts_per_token=1, expert_hidden=8,
                                          num_shared_experts=0, mtp_moe=False))  # fmt: skip
    names = engine_shapes(no_mtp_moe)
    assert not any(n.startswith("mtp.") and "router" in n for n in names)
    assert not any("shared" in n for n in names)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_greedy_tokens_equal_the_trainer_with_moe(
    moe_model: Transformer, dtype: torch.dtype
) -> None:
    model = moe_model.to(dtype)
    try:
        engine = Engine.from_model(model, dtype=dtype, max_batch_size=8)
        for prompt, completion in zip(RAGGED, engine.generate(RAGGED, SamplingParams(10)),
                                      strict=True):  # fmt: skip
            tokens, logps = naive_greedy(model, prompt, 10)
            assert completion.tokens == tokens
            atol = 1e-12 if dtype == torch.float64 else 1e-4
            torch.testing.assert_close(completion.logprobs, logps, rtol=0, atol=atol)
    finally:
        moe_model.float()
    with torch.no_grad():
        model.train()(torch.tensor([RAGGED[1]]))
    model.eval()
    assert expert_load_stats(model)["layers.1.mlp"]["rerouted_fraction"] > 0  # the bias matters


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_with_moe_drafter_equals_plain(moe_model: Transformer, k: int) -> None:
    engine = Engine.from_model(moe_model.double(), dtype=torch.float64, max_batch_size=8)
    moe_model.float()
    plain = engine.generate(RAGGED, SamplingParams(14))
    spec = engine.generate(RAGGED, SamplingParams(14, num_speculative_tokens=k))
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    stats = engine.last_stats
    assert stats is not None and 0 < stats.accepted_at[0] < stats.num_steps


def test_fp8_covers_every_expert_block_and_never_the_router(moe_model: Transformer) -> None:
    engine = Engine.from_model(moe_model, quantize="fp8", max_batch_size=8)
    manifest = engine.manifest()
    for name, shape in engine_shapes(moe_model.cfg).items():
        if "router" in name:
            assert manifest[name] == TensorSpec(
                shape, torch.float32
            ) and name not in matmul_weights(moe_model.cfg)
        elif "experts." in name or "shared." in name:
            assert manifest[name] == TensorSpec(shape, torch.float8_e4m3fn)
            scales = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
            assert manifest[name + "_scale_inv"] == TensorSpec(scales, torch.float32)
    w_EFD = moe_model.state_dict()["layers.1.mlp.experts.w_gate_up"]
    codes, scales = engine.weights["layers.1.mlp.experts.w_gate_up"], engine.weights[
        "layers.1.mlp.experts.w_gate_up_scale_inv"]  # fmt: skip
    for e in range(6):  # each expert's blocks are its own: exactly the 2-D quantization of it
        q, s = quantize_fp8_blockwise(w_EFD[e])
        assert torch.equal(codes[e].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(scales[e], s)
    deq = dequantize_fp8_blockwise(codes, scales)
    assert torch.equal(deq[4], dequantize_fp8_blockwise(codes[4], scales[4]))
    ref = Engine.from_model(moe_model, max_batch_size=8)
    params = SamplingParams(6, temperature=1.0, seed=0)
    out, out_ref = engine.generate(RAGGED, params), ref.generate(RAGGED, params)
    drifts = []
    for c, r in zip(out, out_ref, strict=True):  # the same seeded draws: up to the first fork
        same = [a == b for a, b in zip(c.tokens, r.tokens, strict=True)]
        n = same.index(False) if False in same else len(same)
        drifts += [abs(a - b) for a, b in zip(c.logprobs[:n], r.logprobs[:n], strict=True)]
    print(f"fp8 MoE vs fp32 logprob drift: max {max(drifts):.2e} over {len(drifts)} tokens")
    assert max(drifts) < 0.1


def test_stacks_with_rows_a_multiple_of_the_block_quantize_as_one_matrix() -> None:
    w_Erc = torch.randn(3, 256, 200, generator=torch.Generator().manual_seed(0))
    codes, scales = quantize_fp8_blockwise(w_Erc)
    assert scales.shape == (3, 2, 2)
    for e in range(3):
        q, s = quantize_fp8_blockwise(w_Erc[e])
        assert torch.equal(codes[e].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(scales[e], s)


def test_bf16_engine_keeps_router_tensors_in_fp32(moe_model: Transformer) -> None:
    engine = Engine.from_model(moe_model, dtype=torch.bfloat16, max_batch_size=8)
    w = engine.weights
    assert w["layers.1.mlp.router_bias"].dtype == torch.float32
    assert w["mtp.0.block.mlp.router.weight"].dtype == torch.float32
    assert w["layers.1.mlp.experts.w_down"].dtype == torch.bfloat16
    torch.testing.assert_close(w["layers.1.mlp.router_bias"], moe_model.blocks[1].mlp.router_bias)
    out = engine.generate(RAGGED, SamplingParams(4))
    assert all(len(c.tokens) == 4 for c in out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_moe_engine_matches_trainer_and_runs_bf16(moe_model: Transformer) -> None:
    """fp32 on CUDA (eager) gives the CPU trainer's greedy tokens; bf16 (grouped GEMMs) replayed
    from CUDA graphs gives the tokens of the eager bf16 engine, plain and speculative."""
    cuda_model = Transformer(moe_model.cfg).cuda().eval()
    cuda_model.load_state_dict(moe_model.state_dict())
    engine = Engine.from_model(cuda_model, device="cuda", max_batch_size=8, cuda_graphs=False)
    for prompt, completion in zip(RAGGED, engine.generate(RAGGED, SamplingParams(8)), strict=True):
        assert completion.tokens == naive_greedy(moe_model, prompt, 8)[0]
    kw = dict(device="cuda", dtype=torch.bfloat16, max_batch_size=8)
    graphs = Engine.from_model(cuda_model, **kw)  # type: ignore[arg-type]
    eager = Engine.from_model(cuda_model, cuda_graphs=False, **kw)  # type: ignore[arg-type]
    for k in (0, 2):
        params = SamplingParams(8, num_speculative_tokens=k)
        got, want = graphs.generate(RAGGED, params), eager.generate(RAGGED, params)
        assert [c.tokens for c in got] == [c.tokens for c in want]
    assert graphs.graphs is not None and graphs.graphs.num_captured > 0
