"""The refit plan: replays must deliver current values and every invalidation must be caught."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from refit_helpers import PROMPTS, make_engine, make_model, run, tiny_config

from birkhoff.model import Transformer
from birkhoff.refit import RefitError, refit
from birkhoff.refit.bucket import Bucket
from birkhoff.refit.plan import RefitPlan, current_plan
from birkhoff.refit.session import RefitReport
from birkhoff.refit.transport import InProcessTransport

CFG = tiny_config()
BUCKETS = [16, 1000, 1 << 20]  # every tensor split, some split, one bucket


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype
        and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        for n in a
    )


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


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("bucket_bytes", BUCKETS)
def test_replayed_refit_after_train_steps_equals_fresh_engine(
    bucket_bytes: int, quantize: str | None
) -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(make_model(CFG, seed=1), dtype=torch.bfloat16, quantize=quantize)
    refit(model, engine, bucket_bytes=bucket_bytes, quantize=quantize)
    plan = current_plan(model)
    assert plan is not None and bit_equal(engine.weights, fresh(model, quantize=quantize))
    num_fp8 = sum(spec.dtype == torch.float8_e4m3fn for spec in engine.manifest().values())
    assert len(plan.recipes) == num_fp8 and (num_fp8 > 0) == (quantize == "fp8")
    direct = sum(len(b.quantize_now) for b in plan.buckets)  # quantized straight into buckets
    if bucket_bytes == 1 << 20:  # one bucket: every code and scale tensor lands whole
        assert direct == num_fp8
    if bucket_bytes == 16:  # every one is split: quantized into a temporary, then copied
        assert direct == 0
    for step in range(3):
        train_step(model, seed=step)
        assert not bit_equal(engine.weights, fresh(model, quantize=quantize))
        report = refit(model, engine, bucket_bytes=bucket_bytes, quantize=quantize)
        assert current_plan(model) is plan  # replayed, not re-recorded
        assert report.version == engine.weight_version == step + 2
        assert bit_equal(engine.weights, fresh(model, quantize=quantize))


def test_committed_weights_are_never_overwritten_by_a_later_refit() -> None:
    """The engine (or a generation) may still read version n while version n+1 is packed."""
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16)
    refit(model, engine, bucket_bytes=1 << 20)
    served = []
    for step in range(3):
        served.append((engine.weights, {n: t.clone() for n, t in engine.weights.items()}))
        train_step(model, seed=step)
        refit(model, engine, bucket_bytes=1 << 20)
    assert all(bit_equal(held, snapshot) for held, snapshot in served)
    storages = [{t.untyped_storage().data_ptr() for t in held.values()} for held, _ in served]
    assert not set.intersection(*storages)


def data_ptrs(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in weights.items()}


def test_steady_state_replays_alternate_two_banks() -> None:
    """Nobody keeps old versions: refit n+2 writes where refit n wrote, no new buffers."""
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16)
    # several buckets, no tensor split (a split tensor is reassembled into new staging memory)
    bucket_bytes = max(t.numel() * t.itemsize for t in engine.weights.values())
    refit(model, engine, bucket_bytes=bucket_bytes)
    plan = current_plan(model)
    assert plan is not None
    where = []
    for step in range(5):
        train_step(model, seed=step)
        assert refit(model, engine, bucket_bytes=bucket_bytes).num_buckets > 1
        where.append(data_ptrs(engine.weights))
        assert bit_equal(engine.weights, fresh(model))
    assert current_plan(model) is plan and plan.banks.made == 2
    assert where[0] == where[2] == where[4] and where[1] == where[3]
    assert not set(where[0].values()) & set(where[1].values())


@pytest.mark.parametrize("keep", ["tensor", "view", "slice_of_bytes"])
def test_a_kept_tensor_or_view_of_an_old_version_is_never_overwritten(keep: str) -> None:
    """One kept tensor object, or any tensor on its memory, makes its bank off-limits."""
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16)
    for _ in range(3):  # planless, then both banks: the kept version is served from a bank
        refit(model, engine, bucket_bytes=1 << 20)
    name = next(n for n, t in engine.weights.items() if t.dim() == 2)
    weight = engine.weights[name]
    kept = {
        "tensor": weight,
        "view": weight.t()[1:],
        "slice_of_bytes": weight.reshape(-1).view(torch.uint8)[:64],
    }[keep]
    del weight
    snapshot = kept.clone()
    for step in range(4):
        train_step(model, seed=step)
        refit(model, engine, bucket_bytes=1 << 20)
        assert torch.equal(kept, snapshot), f"kept {keep} overwritten by refit {step + 2}"
    assert bit_equal(engine.weights, fresh(model))


def test_generate_between_refits_sees_each_version() -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(make_model(CFG, seed=1), dtype=torch.bfloat16)
    refit(model, engine, bucket_bytes=1000)
    for step in range(2):
        got = run(engine)
        want = run(make_engine(model, dtype=torch.bfloat16))
        assert [r[:2] for r in got] == [r[:2] for r in want]
        assert {r[2] for r in got} == {engine.weight_version}
        train_step(model, seed=step)
        refit(model, engine, bucket_bytes=1000)
    want = run(make_engine(model, dtype=torch.bfloat16))
    assert [r[:2] for r in run(engine)] == [r[:2] for r in want] and len(want) == len(PROMPTS)


def test_replaced_parameter_object_is_picked_up() -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16)
    refit(model, engine, bucket_bytes=1000)
    plan = current_plan(model)
    module = model.get_submodule("layers.0.attn.wq")
    module.weight = torch.nn.Parameter(torch.randn_like(module.weight))
    refit(model, engine, bucket_bytes=1000)
    assert current_plan(model) is not plan
    assert bit_equal(engine.weights, fresh(model))


@pytest.mark.parametrize("quantize", [None, "fp8"])
def test_parameter_data_swapped_in_place_is_picked_up(quantize: str | None) -> None:
    """`p.data = t` keeps the Parameter object but moves its storage: the plan must follow."""
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16, quantize=quantize)
    refit(model, engine, bucket_bytes=1000, quantize=quantize)
    for p in model.parameters():
        p.data = torch.randn_like(p)
    refit(model, engine, bucket_bytes=1000, quantize=quantize)
    assert bit_equal(engine.weights, fresh(model, quantize=quantize))


def test_replaced_module_and_reshaped_parameter_are_picked_up() -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16)
    refit(model, engine, bucket_bytes=1000)
    donor = make_model(CFG, seed=5)
    name, child = next(iter(model.named_children()))
    setattr(model, name, copy.deepcopy(getattr(donor, name)))
    refit(model, engine, bucket_bytes=1000)
    assert bit_equal(engine.weights, fresh(model))
    # a shape change through .data: the plan must not broadcast into the old layout
    p = next(p for p in model.parameters() if p.dim() == 2)
    p.data = torch.randn(p.shape[0] + 1, p.shape[1])
    with pytest.raises(RefitError):
        refit(model, engine, bucket_bytes=1000)
    assert engine.weight_version == 2


@pytest.mark.parametrize("sizes", [(1000, 1 << 20), (1 << 20, 16), (16, 1000)])
def test_changed_bucket_size_is_picked_up(sizes: tuple[int, int]) -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16)
    refit(model, engine, bucket_bytes=sizes[0])
    train_step(model, seed=0)
    report = refit(model, engine, bucket_bytes=sizes[1])
    plan = current_plan(model)
    assert plan is not None and plan.bucket_bytes == sizes[1]
    assert report.num_buckets == len(plan.buckets)
    assert bit_equal(engine.weights, fresh(model))


def test_changed_manifest_is_picked_up() -> None:
    """The same model refits a bf16 engine, then an fp32 one, then the bf16 one again."""
    model = make_model(CFG, seed=0)
    bf16 = make_engine(make_model(CFG, seed=1), dtype=torch.bfloat16)
    fp32 = make_engine(make_model(CFG, seed=1), dtype=torch.float32)
    for step, (engine, dtype) in enumerate([(bf16, torch.bfloat16), (fp32, torch.float32),
                                             (bf16, torch.bfloat16)]):  # fmt: skip
        train_step(model, seed=step)
        refit(model, engine, bucket_bytes=1000)
        assert bit_equal(engine.weights, fresh(model, dtype))


def test_failed_refit_keeps_engine_and_a_later_replay_recovers() -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(model, dtype=torch.bfloat16)
    refit(model, engine, bucket_bytes=1000)
    before = engine.weights
    with pytest.raises(RefitError):
        refit(make_model(tiny_config(mtp_depth=1), seed=2), engine, bucket_bytes=1000)
    assert engine.weights is before and engine.weight_version == 1
    train_step(model, seed=0)
    refit(model, engine, bucket_bytes=1000)
    assert bit_equal(engine.weights, fresh(model))


class CopyingTransport(InProcessTransport):
    """A transport that copies each payload (like a broadcast): the sender reuses buffers."""

    adopts_buckets = False

    def send(self, bucket: Bucket) -> None:
        assert not bucket.transferable
        self.session.load_bucket(Bucket(bucket.index, bucket.buffer.clone(), bucket.entries, True))


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("bucket_bytes", BUCKETS)
def test_replay_through_a_copying_transport(bucket_bytes: int, quantize: str | None) -> None:
    model = make_model(CFG, seed=0)
    engine = make_engine(make_model(CFG, seed=1), dtype=torch.bfloat16, quantize=quantize)
    for step in range(3):
        transport = CopyingTransport(engine)
        report = refit(model, None, bucket_bytes=bucket_bytes, quantize=quantize,
                       transport=transport)  # fmt: skip
        assert isinstance(report, RefitReport) and report.version == step + 1
        assert bit_equal(engine.weights, fresh(model, quantize=quantize))

        train_step(model, seed=step)


def direct_outputs(plan: RefitPlan) -> list[set[tuple[int, int]]]:
    """Per bucket, the (recipe, output) pairs quantized straight into its memory."""
    return [{(r, o) for g in b.groups for r, o, _ in g.direct} for b in plan.buckets]


@pytest.mark.parametrize("adopts", [True, False])
def test_fp8_codes_and_scales_in_different_buckets(adopts: bool) -> None:
    """A bucket exactly as large as the biggest code tensor pushes its scales to the next bucket.

    In process, both are still quantized straight into bucket memory; with cycled buffers (a
    copying transport) only when they share a bucket, since the next bucket's buffer may still
    be in flight as the previous bucket's payload.
    """
    model = make_model(CFG, seed=0)
    engine = make_engine(make_model(CFG, seed=1), dtype=torch.bfloat16, quantize="fp8")
    fp8 = [s for s in engine.manifest().values() if s.dtype == torch.float8_e4m3fn]
    bucket_bytes = max(math.prod(s.shape) for s in fp8)
    for step in range(3):
        transport = InProcessTransport(engine) if adopts else CopyingTransport(engine)
        refit(model, None, bucket_bytes=bucket_bytes, quantize="fp8", transport=transport)
        assert bit_equal(engine.weights, fresh(model, quantize="fp8"))
        train_step(model, seed=step)
    plan = current_plan(model)
    assert plan is not None
    per_bucket = direct_outputs(plan)
    split = [r for outs in per_bucket for r, o in outs
             if o == 0 and (r, 1) not in outs]  # fmt: skip
    if adopts:
        assert split, "expected a weight whose scales land in the next bucket"
        assert sum(len(b.quantize_now) for b in plan.buckets) == len(fp8)
    else:
        assert not split
        for outs, bucket in zip(per_bucket, plan.buckets, strict=True):
            assert {r for r, _ in outs} == set(bucket.quantize_now)
