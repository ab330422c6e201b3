"""RefitSession and refit(): no false alarm at any bucket size, each fault named, atomic commit."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from refit_helpers import (
    PROMPTS,
    bit_equal,
    make_engine,
    make_model,
    pack_buckets,
    run,
    tiny_config,
    trainer_logprobs,
)
from torch import Tensor

from birkhoff.refit import RefitError, RefitSession, refit

CFG = tiny_config()
MODEL_A = make_model(CFG, seed=0)  # what the engine serves first
MODEL_B = make_model(CFG, seed=1)  # the update
MODEL_BYTES = sum(t.numel() * t.element_size() for t in MODEL_B.state_dict().values())


bucket_sizes = st.one_of(
    st.integers(16, 512), st.integers(512, 65536), st.integers(MODEL_BYTES, 4 * MODEL_BYTES)
)


@given(bucket_bytes=bucket_sizes)
@settings(max_examples=12, deadline=None)
def test_refit_any_bucket_size_is_exact(bucket_bytes: int) -> None:
    engine = make_engine(MODEL_A)
    report = refit(MODEL_B, engine, bucket_bytes=bucket_bytes, check_finite=True)
    assert report.version == engine.weight_version == 1
    assert report.num_tensors == len(engine.manifest())
    assert report.num_buckets >= report.bytes // bucket_bytes
    assert bit_equal(engine.weights, dict(served_b(None)))
    for prompt, (tokens, logprobs, version) in zip(PROMPTS, run(engine), strict=True):
        assert version == 1
        expected = trainer_logprobs(MODEL_B, prompt, tokens)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)


def test_buckets_without_mtp_weights_raise_nothing_until_finish() -> None:
    """The seam that broke elsewhere: a bucket holding no drafter weight is not an error."""
    engine = make_engine(MODEL_A)
    served = served_b(None)
    main = [(n, t) for n, t in served if not n.startswith("mtp.")]
    drafter = [(n, t) for n, t in served if n.startswith("mtp.")]
    session = RefitSession(engine)
    session.begin()
    for bucket in pack_buckets(main, 1024, device="cpu"):
        session.load_bucket(bucket)
    assert engine.weight_version == 0
    for bucket in pack_buckets(drafter, 1024, device="cpu"):
        session.load_bucket(bucket)
    assert session.finish().version == 1


# ---- faults: each names the tensor, leaves the engine's weights, version and outputs alone ----

Named = list[tuple[str, Tensor]]


def drop(named: Named, name: str) -> Named:
    return [(n, t) for n, t in named if n != name]


def duplicate(named: Named, name: str) -> Named:
    return named + [(n, t) for n, t in named if n == name]


def reshape(named: Named, name: str) -> Named:
    return [(n, t.reshape(1, *t.shape) if n == name else t) for n, t in named]


def recast(named: Named, name: str) -> Named:
    other = torch.float16 if name.endswith("_scale_inv") else torch.float64
    return [(n, t.to(other) if n == name else t) for n, t in named]


def poison(named: Named, name: str) -> Named:
    def nan(t: Tensor) -> Tensor:
        t = t.clone()
        t.reshape(-1).view(torch.uint8)[: t.element_size()] = 0xFF  # NaN in every float format
        return t

    return [(n, nan(t) if n == name else t) for n, t in named]


def extra(named: Named, name: str) -> Named:
    return named + [(name + ".extra", torch.zeros(3))]


FAULTS: dict[str, tuple[Callable[[Named, str], Named], str, Callable[[str], str]]] = {
    "drop": (drop, "missing", lambda n: n),
    "duplicate": (duplicate, "duplicated", lambda n: n),
    "reshape": (reshape, "mismatched", lambda n: n),
    "recast": (recast, "mismatched", lambda n: n),
    "nan": (poison, "non_finite", lambda n: n),
    "unexpected": (extra, "unexpected", lambda n: n + ".extra"),
}
NAMES = ["embed.weight", "layers.1.attn.wqkv.weight", "mtp.1.proj.weight", "mtp.0.norm.weight",
         "mtp.1.block.hc_mlp.phi"]  # fmt: skip


@functools.cache
def outputs_of_a(quantize: str | None) -> Any:
    return run(make_engine(MODEL_A, quantize=quantize))


@functools.cache
def served_b(quantize: str | None) -> Named:
    return list(make_engine(MODEL_B, quantize=quantize).weights.items())


def snapshot(engine: Any) -> tuple[int, dict[str, Tensor], Any]:
    return engine.weight_version, dict(engine.weights), outputs_of_a(engine.quantize)


def assert_unchanged(engine: Any, before: tuple[int, dict[str, Tensor], Any]) -> None:
    version, weights, outputs = before
    assert engine.weight_version == version
    assert engine.weights.keys() == weights.keys()
    assert all(engine.weights[n] is weights[n] for n in weights)
    assert run(engine) == outputs


def load_all(engine: Any, named: Named, *, check_finite: bool, bucket_bytes: int = 256) -> Any:
    session = RefitSession(engine)
    session.begin()
    for bucket in pack_buckets(named, bucket_bytes, device="cpu"):
        session.load_bucket(bucket)
    return session.finish(check_finite=check_finite)


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_named_and_engine_unchanged(fault: str, name: str, quantize: str | None) -> None:
    if quantize == "fp8" and name == "mtp.1.proj.weight":
        name += "_scale_inv"  # the drafter's fp8 scale is a served tensor like any other
    engine = make_engine(MODEL_A, quantize=quantize)
    before = snapshot(engine)
    inject, field, expected_name = FAULTS[fault]
    named = inject(served_b(quantize), name)
    with pytest.raises(RefitError) as info:
        load_all(engine, named, check_finite=True)
    assert expected_name(name) in getattr(info.value, field), str(info.value)
    assert expected_name(name) in str(info.value)
    others = {k: v for k, v in vars(info.value).items() if k != field and v}
    assert not {k: v for k, v in others.items() if k not in ("args",)}, others
    assert_unchanged(engine, before)


def test_nan_passes_without_check_finite_and_is_caught_with_it() -> None:
    named = poison(served_b(None), "norm.weight")
    engine = make_engine(MODEL_A)
    with pytest.raises(RefitError, match="norm.weight"):
        load_all(engine, named, check_finite=True)
    assert load_all(engine, named, check_finite=False).version == 1


def test_lost_chunk_of_a_split_tensor_is_incomplete() -> None:
    engine = make_engine(MODEL_A)
    before = snapshot(engine)
    buckets = list(pack_buckets(served_b(None), 64, device="cpu"))
    lost = next(b for b in buckets if any(e.chunk_offset > 0 for e in b.entries))
    split = next(e.name for e in lost.entries if e.chunk_offset > 0)
    session = RefitSession(engine)
    session.begin()
    for bucket in buckets:
        if bucket is not lost:
            session.load_bucket(bucket)
    with pytest.raises(RefitError) as info:
        session.finish()
    assert split in info.value.incomplete and not info.value.missing
    assert_unchanged(engine, before)


def test_a_chunk_sent_twice_is_duplicated_not_overwritten() -> None:
    engine = make_engine(MODEL_A)
    session = RefitSession(engine)
    session.begin()
    buckets = list(pack_buckets(served_b(None), 128, device="cpu"))
    for bucket in buckets + buckets[3:4]:
        session.load_bucket(bucket)
    names = {e.name for e in buckets[3].entries}
    with pytest.raises(RefitError) as info:
        session.finish()
    assert set(info.value.duplicated) == names


def test_abort_and_protocol_errors_leave_engine_alone() -> None:
    engine = make_engine(MODEL_A)
    before = snapshot(engine)
    session = RefitSession(engine)
    with pytest.raises(RuntimeError, match="begin"):
        session.load_bucket(next(pack_buckets([("x", torch.zeros(1))], 64, device="cpu")))
    session.begin()
    with pytest.raises(RuntimeError, match="already begun"):
        session.begin()
    for bucket in pack_buckets(served_b(None), 4096, device="cpu"):
        session.load_bucket(bucket)
    session.abort()
    with pytest.raises(RuntimeError, match="begin"):
        session.finish()
    assert_unchanged(engine, before)


def test_refit_argument_errors() -> None:
    engine = make_engine(MODEL_A)
    with pytest.raises(ValueError, match="quantize='fp8'"):
        refit(MODEL_B, engine, quantize="fp8")
    with pytest.raises(ValueError, match="quantize='int4'"):
        refit(MODEL_B, engine, quantize="int4")
    with pytest.raises(ValueError, match="bucket_bytes"):
        refit(MODEL_B, engine, bucket_bytes=3)
    assert engine.weight_version == 0
    assert refit(MODEL_B, engine).version == 1  # the failed calls left no session open


def test_missing_or_mis_shaped_trainer_tensor_is_a_refit_error() -> None:
    """The sender looks every source up by name: a gap in the model is named, nothing sent."""
    engine = make_engine(MODEL_A)
    before = snapshot(engine)
    broken = make_model(CFG, seed=1)
    del broken.mtp[1].proj.weight
    broken.layers[0].mlp.w_up.weight = torch.nn.Parameter(torch.zeros(3, CFG.dim))
    with pytest.raises(RefitError) as info:
        refit(broken, engine)
    assert info.value.missing == ["mtp.1.proj.weight"]
    assert list(info.value.mismatched) == ["layers.0.mlp.w_up.weight"]
    assert_unchanged(engine, before)
    with pytest.raises(RefitError) as info:  # a model whose layout lacks served tensors
        refit(make_model(tiny_config(mtp_depth=1), seed=2), engine)
    assert info.value.missing and all(n.startswith("mtp.1.") for n in info.value.missing)
    assert_unchanged(engine, before)


def test_in_process_refit_serves_bucket_memory_without_copying() -> None:
    engine = make_engine(MODEL_A)
    refit(MODEL_B, engine, bucket_bytes=1 << 20)
    storages = {t.untyped_storage().data_ptr() for t in engine.weights.values()}
    assert len(storages) < len(engine.weights) // 10  # whole tensors are views of few buckets
    assert bit_equal(engine.weights, dict(served_b(None)))
