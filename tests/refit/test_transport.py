"""Broadcast refit over torch.distributed (gloo, CPU): one trainer rank, two engine ranks.

Rank 0 holds the trainer; ranks 1 and 2 each serve an engine. Three refits run in sequence:
a good one (both engines commit, bit-identical to a direct load), one that rank 2 rejects (its
engine serves fp8, the update is bf16-shaped for rank 1's manifest) so neither rank commits, and an
aborted one. Workers assert locally; a failing assertion fails the spawn.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from refit_helpers import make_engine, make_model, pack_buckets, run, tiny_config

from birkhoff.refit import BroadcastSender, RefitError, refit, serve_refit

WORLD = 3


def _trainer(cfg_seed: int) -> None:
    model_b = make_model(tiny_config(), seed=cfg_seed)
    sender = BroadcastSender(src=0, engine_src=1)
    report = refit(model_b, None, bucket_bytes=4096, transport=sender, check_finite=True)
    assert report.version == 1, report
    # second refit: rank 2's engine rejects it, so the trainer sees the merged RefitError
    with pytest.raises(RefitError) as info:
        refit(model_b, None, bucket_bytes=4096, transport=sender)
    assert info.value.mismatched and info.value.missing
    # third: abort half way through
    sender.begin()
    named = [(n, torch.zeros(s.shape, dtype=s.dtype)) for n, s in sender.manifest().items()]
    sender.send(next(pack_buckets(named, 1024, device="cpu")))
    sender.abort()


def _engine(rank: int, cfg_seed: int) -> None:
    cfg = tiny_config()
    model_a, model_b = make_model(cfg, seed=0), make_model(cfg, seed=cfg_seed)
    quantize = None if rank == 1 else "fp8"
    # first refit: both engines serve fp32; rank 2 switches to an fp8 engine before the second
    engine = make_engine(model_a)
    report = serve_refit(engine, src=0, engine_src=1)
    assert report is not None and report.version == engine.weight_version == 1
    direct = make_engine(model_b)
    assert all(torch.equal(engine.weights[n], direct.weights[n]) for n in direct.weights)
    if quantize:
        engine = make_engine(model_a, quantize=quantize)
    before = (engine.weight_version, run(engine))
    with pytest.raises(RefitError):
        serve_refit(engine, src=0, engine_src=1)
    assert (engine.weight_version, run(engine)) == before
    assert serve_refit(engine, src=0, engine_src=1) is None
    assert (engine.weight_version, run(engine)) == before


def _worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        if rank == 0:
            _trainer(cfg_seed=1)
        else:
            _engine(rank, cfg_seed=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_broadcast_refit_two_engine_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    # fork: the children reuse the parent's imports (spawn re-imports torch in each, ~seconds)
    mp.start_processes(_worker, args=(str(tmp_path / "init"),), nprocs=WORLD, join=True,
                       start_method="fork")  # fmt: skip
