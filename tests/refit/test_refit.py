"""refit() end to end: fp8 and bf16 engines, a training step, other model shapes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from refit_helpers import PROMPTS, bit_equal, make_engine, make_model, run, tiny_config

from birkhoff.engine.fp8 import FP8_DTYPE
from birkhoff.refit import refit

CFG = tiny_config()
MODEL_A = make_model(CFG, seed=0)
MODEL_B = make_model(CFG, seed=1)


@pytest.mark.parametrize("bucket_bytes", [16, 1000, 1 << 24])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_refit_equals_direct_fp8_load(bucket_bytes: int, dtype: torch.dtype) -> None:
    engine = make_engine(MODEL_A, dtype=dtype, quantize="fp8")
    report = refit(MODEL_B, engine, bucket_bytes=bucket_bytes, quantize="fp8", check_finite=True)
    direct = make_engine(MODEL_B, dtype=dtype, quantize="fp8")
    assert report.version == 1 and report.num_tensors == len(direct.manifest())
    assert any(t.dtype == FP8_DTYPE for t in engine.weights.values())
    assert bit_equal(engine.weights, direct.weights)
    assert [r[:2] for r in run(engine)] == [r[:2] for r in run(direct)]


def test_bf16_refit_equals_direct_bf16_load() -> None:
    engine = make_engine(MODEL_A, dtype=torch.bfloat16)
    refit(MODEL_B, engine, bucket_bytes=4096)
    assert bit_equal(engine.weights, make_engine(MODEL_B, dtype=torch.bfloat16).weights)


def test_fp8_logprob_drift_against_bf16_is_reported(record_property: Any) -> None:
    """Greedy logprobs of an fp8 engine vs a bf16 one, over the prefix where tokens agree."""
    bf16 = make_engine(MODEL_A, dtype=torch.bfloat16)
    fp8 = make_engine(MODEL_A, dtype=torch.bfloat16, quantize="fp8")
    refit(MODEL_B, bf16, bucket_bytes=1 << 16)
    refit(MODEL_B, fp8, bucket_bytes=1 << 16, quantize="fp8")
    diffs, agreed, total = [], 0, 0
    for (tok_a, lp_a, _), (tok_b, lp_b, _) in zip(run(bf16, 12), run(fp8, 12), strict=True):
        total += len(tok_a)
        for ta, tb, la, lb in zip(tok_a, tok_b, lp_a, lp_b, strict=True):
            if ta != tb:
                break
            agreed += 1
            diffs.append(abs(la - lb))
    drift = torch.tensor(diffs)
    summary = (f"fp8 vs bf16 greedy: {agreed}/{total} tokens agree; |dlogprob| over agreed "
               f"prefix: mean {drift.mean():.2e}, max {drift.max():.2e}")  # fmt: skip
    print("\n" + summary)
    record_property("fp8_logprob_drift", summary)
    # loose sanity bound: e4m3 weights (~2-3% per element) move a logprob of ~-4 by a few %
    assert agreed >= len(PROMPTS) and float(drift.max()) < 0.25


def train_step(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (4, 16), generator=g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    loss = model(ids, labels=ids).loss
    assert loss is not None
    loss.backward()
    optimizer.step()


@pytest.mark.parametrize("sampling", [{}, {"num_speculative_tokens": 2},
                                      {"temperature": 1.0, "top_p": 0.9, "seed": 7}])  # fmt: skip
def test_after_training_step_refit_generates_like_a_fresh_engine(sampling: dict[str, Any]) -> None:
    trained = copy.deepcopy(MODEL_A)
    train_step(trained, seed=0)
    engine = make_engine(MODEL_A)
    refit(trained, engine, bucket_bytes=2048, check_finite=True)
    fresh = make_engine(trained)
    assert not bit_equal(engine.weights, make_engine(MODEL_A).weights)
    after, expected = run(engine, 8, **sampling), run(fresh, 8, **sampling)
    assert [r[:2] for r in after] == [r[:2] for r in expected]
    assert {r[2] for r in after} == {engine.weight_version} == {1}


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_embeddings": True},
        {"num_streams": 1, "mtp_depth": 0},
        {"mtp_depth": 3, "num_kv_heads": 1},
    ],
)
def test_other_shapes(overrides: dict[str, Any]) -> None:
    cfg = tiny_config(**overrides)
    engine = make_engine(make_model(cfg, seed=0))
    new = make_model(cfg, seed=1)
    assert refit(new, engine, bucket_bytes=300).version == 1
    assert bit_equal(engine.weights, make_engine(new).weights)
