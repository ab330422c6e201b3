"""Refit from FSDP2 shards on 2 gloo ranks: each rank's engine equals a fresh engine of the
full model, bucket by bucket, with no more than one bucket's tensors gathered at a time."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from refit_helpers import make_engine, make_model, run, tiny_config

import birkhoff.refit.api as api
from birkhoff.engine.layout import engine_parts
from birkhoff.refit.session import RefitError
from birkhoff.refit.sharded import GatheredSources
from birkhoff.runtime.distributed import shard_model

BUCKET_BYTES = 4096  # smaller than the embedding: chunked tensors and many buckets


def _refit_worker(rank: int, out: Path) -> None:
    cfg = tiny_config()
    model = make_model(cfg, seed=0)
    engines = {q: make_engine(model, quantize=q) for q in (None, "fp8")}  # before sharding
    shard_model(model, device_type="cpu")
    with torch.no_grad():  # an update: every shard moves, on every rank differently
        for p in model.parameters():
            p.to_local().add_(0.01 * (rank + 1))
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    seen: list[GatheredSources] = []
    plain_gathered = api.gathered

    def recording(sources):  # type: ignore[no-untyped-def]
        wrapped = plain_gathered(sources)
        seen.append(wrapped)
        return wrapped

    api.gathered = recording
    reports = {q: api.refit(model, e, bucket_bytes=BUCKET_BYTES, quantize=q)
               for q, e in engines.items()}  # fmt: skip
    results = {q: ({n: t.clone() for n, t in e.weights.items()}, run(e), reports[q].num_buckets)
               for q, e in engines.items()}  # fmt: skip
    bounds = [(s.max_kept_bytes, s.gathered_bytes) for s in seen]
    torch.save({"full": full, "results": results, "bounds": bounds}, out / f"rank{rank}.pt")
    with pytest.raises(RefitError, match="non-finite"):  # still one check: refused everywhere
        with torch.no_grad():
            model.layers[0].attn.wq.weight.to_local().fill_(float("nan"))
        api.refit(model, engines[None], bucket_bytes=BUCKET_BYTES, check_finite=True)
    assert engines[None].weight_version == reports[None].version


def test_refit_from_shards_equals_a_fresh_engine_on_every_rank(tmp_path: Path) -> None:
    run_ranks(_refit_worker, tmp_path)
    cfg = tiny_config()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        model = make_model(cfg, seed=0)
        model.load_state_dict(got["full"], strict=False)
        for q in (None, "fp8"):
            fresh = make_engine(model, quantize=q)
            weights, completions, num_buckets = got["results"][q]
            assert num_buckets > 4
            assert weights.keys() == fresh.weights.keys()
            for name, tensor in fresh.weights.items():
                assert torch.equal(weights[name].view(torch.uint8), tensor.view(torch.uint8)), name
            assert [c[:2] for c in completions] == [c[:2] for c in run(fresh)]
        # a served tensor larger than a bucket (fused gate/up here) is made whole either way
        largest = 4 * max(sum(math.prod(shape) for _, shape in parts)
                          for parts in engine_parts(cfg).values())  # fmt: skip
        for kept, total in got["bounds"]:
            assert total >= sum(p.numel() * p.element_size() for p in got["full"].values()) // 2
            assert 0 < kept <= max(2 * BUCKET_BYTES, largest)  # fp32 sources of a bf16 bucket
            assert kept < total / 4  # far from the whole model at once
