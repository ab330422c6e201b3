"""Packing: every refit reads current values, the layout is memoised, bank memory is reused
only where the ownership rule allows."""

from __future__ import annotations

import copy

import pytest
import torch
from refit_helpers import PROMPTS, bit_equal, make_engine, make_model, run, tiny_config

from birkhoff.engine import Engine
from birkhoff.model import Transformer
from birkhoff.refit import Bucket, RefitError, RefitReport, refit
from birkhoff.refit.pack import Bank, RefitLayout, manifest_key, refit_layout
from birkhoff.refit.transport import InProcessTransport

CFG = tiny_config()
BUCKETS = [16, 1000, 1 << 20]  # every tensor split, some split, one bucket


def fresh(
    model: Transformer, dtype: torch.dtype = torch.bfloat16, quantize: str | None = None
) -> dict[str, torch.Tensor]:
    return make_engine(model, dtype=dtype, quantize=quantize).weights


def train_step(model: Transformer, seed: int) -> None:
    """One real optimizer step (in place), so every weight changes."""
    torch.manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (2, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(ids, labels=ids).loss
    assert loss is not None
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def layout_of(engine: Engine, bucket_bytes: int) -> RefitLayout:
    return refit_layout(CFG, manifest_key(engine.manifest()), bucket_bytes)


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("bucket_bytes", BUCKETS)
def test_refits_after_train_steps_equal_a_fresh_engine(
    bucket_bytes: int, quantize: str | None
) -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(make_model(CFG, seed=1), dtype=torch.bfloat16, quantize=quantize)
    layout = layout_of(engine, bucket_bytes)
    num_fp8 = sum(spec.dtype == torch.float8_e4m3fn for spec in engine.manifest().values())
    direct = sum(len(b.quantize) for b in layout.buckets)  # quantized straight into buckets
    if bucket_bytes == 1 << 20:  # one bucket: every code and scale tensor lands whole
        assert direct == num_fp8
    if bucket_bytes == 16:  # every one is split: quantized into a temporary, then copied
        assert direct == 0
    for step in range(4):
        report = refit(model, engine, bucket_bytes=bucket_bytes, quantize=quantize)
        assert layout_of(engine, bucket_bytes) is layout  # memoised, never rebuilt
        assert report.version == engine.weight_version == step + 1
        assert report.num_buckets == len(layout.buckets)
        assert bit_equal(engine.weights, fresh(model, quantize=quantize))
        train_step(model, seed=step)
        assert not bit_equal(engine.weights, fresh(model, quantize=quantize))


def test_a_version_stays_intact_until_the_refit_that_makes_version_n_plus_2() -> None:
    """The ownership rule: the refit after next may reuse version n's memory, no sooner."""
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16)
    for step in range(4):
        kept, snapshot = engine.weights, {n: t.clone() for n, t in engine.weights.items()}
        train_step(model, seed=step)
        refit(model, engine, bucket_bytes=1 << 20)
        assert bit_equal(kept, snapshot), f"version {step} overwritten by the next refit"


def data_ptrs(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in weights.items()}


def test_steady_state_refits_alternate_two_banks() -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16)
    # several buckets, no tensor split (a split tensor is reassembled into new staging memory)
    bucket_bytes = max(t.numel() * t.itemsize for t in engine.weights.values())
    where = []
    for step in range(6):
        train_step(model, seed=step)
        assert refit(model, engine, bucket_bytes=bucket_bytes).num_buckets > 1
        where.append(data_ptrs(engine.weights))
        assert bit_equal(engine.weights, fresh(model))
    assert where[0] == where[2] == where[4] and where[1] == where[3] == where[5]
    assert not set(where[0].values()) & set(where[1].values())


def test_failed_refit_never_writes_the_served_memory_and_a_later_refit_recovers() -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16)
    refit(model, engine, bucket_bytes=1000)
    served, snapshot = engine.weights, {n: t.clone() for n, t in engine.weights.items()}
    for _ in range(2):  # the second failure would reuse the first one's bank, never the served one
        train_step(model, seed=0)
        with pytest.raises(RefitError):
            refit(model, engine, bucket_bytes=1000, check_finite=True, quantize=None,
                  transport=NaNTransport(engine))  # fmt: skip
        assert engine.weights is served and engine.weight_version == 1
        assert bit_equal(served, snapshot)
    refit(model, engine, bucket_bytes=1000)
    assert bit_equal(engine.weights, fresh(model)) and engine.weight_version == 2


class NaNTransport(InProcessTransport):
    """Poisons every whole tensor it sends (after the sender wrote it)."""

    def send(self, bucket: Bucket) -> None:
        for view in bucket.views or []:
            if view is not None:
                view.reshape(-1)[0] = float("nan")
        super().send(bucket)


def test_generate_between_refits_sees_each_version() -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(make_model(CFG, seed=1), dtype=torch.bfloat16)
    for step in range(3):
        refit(model, engine, bucket_bytes=1000)
        got = run(engine)
        want = run(make_engine(model, dtype=torch.bfloat16))
        assert [r[:2] for r in got] == [r[:2] for r in want] and len(got) == len(PROMPTS)
        assert {r[2] for r in got} == {engine.weight_version} == {step + 1}
        train_step(model, seed=step)


@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_replaced_parameters_modules_and_data_are_read_by_name(quantize: str | None) -> None:
    """Sources are looked up on every refit: nothing a model swaps can be stale."""
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16, quantize=quantize)
    refit(model, engine, bucket_bytes=1000, quantize=quantize)
    module = model.get_submodule("layers.0.attn.wq")
    module.weight = torch.nn.Parameter(torch.randn_like(module.weight))  # a new Parameter
    refit(model, engine, bucket_bytes=1000, quantize=quantize)
    assert bit_equal(engine.weights, fresh(model, quantize=quantize))
    for p in model.parameters():  # the same Parameters, new storage
        p.data = torch.randn_like(p)
    refit(model, engine, bucket_bytes=1000, quantize=quantize)
    assert bit_equal(engine.weights, fresh(model, quantize=quantize))
    name = next(n for n, _ in model.named_children())
    setattr(model, name, copy.deepcopy(getattr(make_model(CFG, seed=5), name)))  # a new module
    refit(model, engine, bucket_bytes=1000, quantize=quantize)
    assert bit_equal(engine.weights, fresh(model, quantize=quantize))
    p = next(p for p in model.parameters() if p.dim() == 2)
    p.data = torch.randn(p.shape[0] + 1, p.shape[1])  # a shape change: named, nothing sent
    with pytest.raises(RefitError, match="mismatched"):
        refit(model, engine, bucket_bytes=1000, quantize=quantize)
    assert engine.weight_version == 4


@pytest.mark.parametrize("sizes", [(1000, 1 << 20), (1 << 20, 16), (16, 1000)])
def test_changed_bucket_size(sizes: tuple[int, int]) -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16)
    refit(model, engine, bucket_bytes=sizes[0])
    train_step(model, seed=0)
    report = refit(model, engine, bucket_bytes=sizes[1])
    assert report.num_buckets == len(layout_of(engine, sizes[1]).buckets)
    assert bit_equal(engine.weights, fresh(model))


def test_one_model_refits_engines_of_different_manifests() -> None:
    """The same model refits a bf16 engine, then an fp32 one, then the bf16 one again."""
    model = make_model(CFG, seed=0)
    bf16 = make_engine(make_model(CFG, seed=1), dtype=torch.bfloat16)
    fp32 = make_engine(make_model(CFG, seed=1), dtype=torch.float32)
    for step, (engine, dtype) in enumerate([(bf16, torch.bfloat16), (fp32, torch.float32),
                                             (bf16, torch.bfloat16)]):  # fmt: skip
        train_step(model, seed=step)
        refit(model, engine, bucket_bytes=1000)
        assert bit_equal(engine.weights, fresh(model, dtype))


def test_two_engines_with_one_manifest_never_share_bucket_memory() -> None:
    model = make_model(CFG, seed=0)
    first, second = (
        make_engine(model, dtype=torch.bfloat16),
        make_engine(model, dtype=torch.bfloat16),
    )
    for step in range(3):
        train_step(model, seed=step)
        refit(model, first, bucket_bytes=1 << 20)
        kept = {n: t.clone() for n, t in first.weights.items()}
        refit(model, second, bucket_bytes=1 << 20)
        assert bit_equal(first.weights, kept)
        assert not set(data_ptrs(first.weights).values()) & set(data_ptrs(second.weights).values())


class CopyingTransport(InProcessTransport):
    """Copies each payload out (like a broadcast), so the sender may cycle two buffers."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._bank: Bank | None = None

    def bank(self, layout: RefitLayout) -> Bank:
        if self._bank is None or self._bank.layout is not layout:
            size = max(b.nbytes for b in layout.buckets)
            pool = [torch.empty(size, dtype=torch.uint8) for _ in "ab"]
            self._bank = Bank(layout, [pool[i % 2] for i in range(len(layout.buckets))])
        return self._bank

    def send(self, bucket: Bucket) -> None:
        self.session.load_bucket(Bucket(bucket.index, bucket.buffer.clone(), bucket.entries))


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("bucket_bytes", [*BUCKETS, 2048])
def test_refit_through_a_copying_transport_with_cycled_buffers(
    bucket_bytes: int, quantize: str | None
) -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(make_model(CFG, seed=1), dtype=torch.bfloat16, quantize=quantize)
    transport = CopyingTransport(engine)
    for step in range(3):
        report = refit(model, None, bucket_bytes=bucket_bytes, quantize=quantize,
                       transport=transport)  # fmt: skip
        assert isinstance(report, RefitReport) and report.version == step + 1
        assert bit_equal(engine.weights, fresh(model, quantize=quantize))
        train_step(model, seed=step)
