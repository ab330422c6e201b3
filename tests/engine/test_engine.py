"""Engine API: manifest, weight commits and versions, input validation, fp8 weights."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import tiny_config

from birkhoff.engine import Engine, SamplingParams, TensorSpec
from birkhoff.engine.layout import SourceError, engine_shapes, matmul_weights
from birkhoff.model import Transformer

PROMPTS = [[1, 2, 3], [4, 5]]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny_config(tie_embeddings=True)).eval()


def test_manifest_lists_every_served_tensor(model: Transformer) -> None:
    engine = Engine(model.cfg)
    manifest = engine.manifest()
    shapes = engine_shapes(model.cfg)
    assert set(manifest) == set(shapes) and any(n.startswith("mtp.1.") for n in manifest)
    assert all(spec == TensorSpec(shapes[n], torch.float32) for n, spec in manifest.items())
    assert engine.weights == {} and engine.weight_version == -1  # nothing served yet


def test_fp8_manifest_and_logprob_drift(model: Transformer) -> None:
    cfg = model.cfg
    engine = Engine.from_model(model, quantize="fp8")
    manifest = engine.manifest()
    for name, shape in engine_shapes(cfg).items():
        if name in matmul_weights(cfg):
            assert manifest[name] == TensorSpec(shape, torch.float8_e4m3fn)
            scale = ((shape[0] + 127) // 128, (shape[1] + 127) // 128)
            assert manifest[name + "_scale_inv"] == TensorSpec(scale, torch.float32)
        else:  # norms, embeddings (tied lm_head included), mHC coefficients
            assert manifest[name] == TensorSpec(shape, torch.float32)
    assert all(engine.weights[n].dtype == s.dtype for n, s in manifest.items())
    ref = Engine.from_model(model)
    params = SamplingParams(6, temperature=1.0, seed=0)
    out, out_ref = engine.generate(PROMPTS, params), ref.generate(PROMPTS, params)
    drift = max(abs(a - b) for c, r in zip(out, out_ref, strict=True)
                for a, b in zip(c.logprobs, r.logprobs, strict=True))  # fmt: skip
    print(f"fp8 vs fp32 max logprob drift: {drift:.2e}")
    assert drift < 0.05


def test_commit_swaps_weights_and_bumps_version(model: Transformer) -> None:
    engine = Engine.from_model(model)
    assert engine.weight_version == 0
    before = engine.generate(PROMPTS, SamplingParams(4))
    new = {n: t.clone() for n, t in engine.weights.items()}
    new["norm.weight"].mul_(-1.0)  # logits change sign: argmax becomes argmin
    old = engine.weights
    assert engine.commit_weights(new) == 1 and engine.weights is not old
    after = engine.generate(PROMPTS, SamplingParams(4))
    assert [c.weight_version for c in after] == [1, 1] and before[0].weight_version == 0
    assert [c.tokens for c in after] != [c.tokens for c in before]
    with pytest.raises(AssertionError, match="manifest"):
        engine.commit_weights({n: t for n, t in new.items() if n != "mtp.1.norm.weight"})
    assert engine.weight_version == 1


def test_from_model_names_missing_and_mis_shaped_trainer_tensors(model: Transformer) -> None:
    broken = Transformer(model.cfg)
    del broken.mtp[1].proj.weight  # a Parameter the engine serves (as part of no fusion)
    broken.layers[0].attn.wk.weight = torch.nn.Parameter(torch.zeros(3, model.cfg.dim))
    with pytest.raises(SourceError) as info:
        Engine.from_model(broken)
    assert info.value.missing == ["mtp.1.proj.weight"]
    assert list(info.value.mismatched) == ["layers.0.attn.wk.weight"]
    with pytest.raises(ValueError, match="ModelConfig"):
        Engine.from_model(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("prompts", "params", "match"),
    [
        ([[1], []], SamplingParams(2), "prompt 1 is empty"),
        ([list(range(48))], SamplingParams(2), "prompt 0 has length 48 >= max_seq_len=48"),
        ([[1, 16]], SamplingParams(2), "token id 16 outside"),
        ([[1, -1]], SamplingParams(2), "token id -1 outside"),
        ([], SamplingParams(2), "non-empty list"),
        ([[1]], SamplingParams(2, stop_token_ids=(16,)), "stop_token_ids"),
        ([[1]], SamplingParams(2, num_speculative_tokens=5), "num_speculative_tokens=5"),
        ([[1], [2]], [SamplingParams(2)], "1 SamplingParams for 2 prompts"),
        ([[1], [2]], [SamplingParams(2, seed=1), SamplingParams(2, seed=2)], "seed"),
    ],
)
def test_bad_requests_raise_value_error(
    model: Transformer, prompts: list[list[int]], params: SamplingParams, match: str
) -> None:
    engine = Engine.from_model(model)
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, params)


def test_construction_and_drafter_errors() -> None:
    cfg = tiny_config(mtp_depth=0)
    with pytest.raises(ValueError, match="quantize"):
        Engine(cfg, quantize="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_batch_size"):
        Engine(cfg, max_batch_size=0)
    engine = Engine(cfg)
    with pytest.raises(ValueError, match="no weights loaded"):
        engine.generate([[1]], SamplingParams(2))
    engine = Engine.from_model(Transformer(cfg))
    with pytest.raises(ValueError, match="no MTP depth"):
        engine.generate([[1]], SamplingParams(2, num_speculative_tokens=1))


def test_served_phi_buffers_follow_the_committed_tensors() -> None:
    """With the fused kernels, phi is served from a re-laid buffer (same values); a tensor
    committed again (a refit bank's view, rewritten in place) gets its buffer back, refreshed,
    unless that buffer is being served; every other tensor is served as committed."""
    cfg = tiny_config(num_streams=2)
    engine = Engine(cfg, kernels="triton")  # served_phi is plain torch: no kernel
    gen = torch.Generator().manual_seed(0)

    def weights() -> dict[str, torch.Tensor]:
        return {n: torch.randn(s.shape, generator=gen) for n, s in engine.manifest().items()}

    phis = [n for n in engine.manifest() if n.endswith(".phi")]
    assert phis
    bank_a, bank_b = weights(), weights()
    served = []
    for bank in (bank_a, bank_b, bank_a):
        if served:
            for t in bank.values():  # the refit rewrote this bank in place
                t.add_(1.0)
        engine.commit_weights(bank)
        assert all(engine.weights[n] is t for n, t in bank.items() if n not in phis)
        assert all(engine.committed[n] is t for n, t in bank.items())
        for n in phis:
            assert engine.weights[n] is not bank[n] and torch.equal(engine.weights[n], bank[n])
        served.append({n: engine.weights[n] for n in phis})
    assert all(served[2][n] is served[0][n] for n in phis)  # bank a's buffer, refreshed
    assert all(served[1][n] is not served[0][n] for n in phis)
    engine.commit_weights(bank_a)  # the same tensors twice in a row: the served buffer stays
    assert all(engine.weights[n] is not served[2][n] for n in phis)
