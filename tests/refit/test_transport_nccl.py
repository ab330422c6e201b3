"""Broadcast refit over NCCL: trainer on cuda:0, engine on cuda:1 (needs two GPUs).

Per case (a bf16 engine, then fp8 engines at two bucket sizes), three updates must land
bit-identical to a direct load of the same weights on the engine's GPU, and an update with a
NaN weight (check_finite=True) must be rejected on both ranks with the engine unchanged.
Workers assert locally; a failing assertion fails the spawn.
"""

from __future__ import annotations

import copy
import datetime
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from refit_helpers import make_model, tiny_config

from birkhoff.engine import Engine
from birkhoff.engine.layout import build_manifest
from birkhoff.model import Transformer
from birkhoff.refit import BroadcastSender, RefitError, refit, serve_refit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
CFG = tiny_config(dim=256, num_heads=4, vocab_size=1000)
STEPS = 3
# as large as the biggest fp8 code tensor: its scales land in the next bucket, whose (cycled)
# buffer may still be in flight as the previous payload
FULL = max(math.prod(s.shape) for s in build_manifest(CFG, dtype=torch.bfloat16,
                                                      quantize="fp8").values())  # fmt: skip
CASES = [(None, 1 << 16), ("fp8", 1 << 16), ("fp8", FULL)]


def step_weights(model: Transformer, step: int) -> None:
    """The same deterministic update on every rank (drawn on the CPU, then copied)."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g).to(p.device))


def _trainer(quantize: str | None, bucket_bytes: int) -> None:
    model = make_model(CFG, seed=1).to("cuda:0")
    sender = BroadcastSender(src=0, engine_src=1, device="cuda:0")
    for step in range(STEPS):
        step_weights(model, step)
        report = refit(model, None, bucket_bytes=bucket_bytes, quantize=quantize, transport=sender)
        assert report.version == step + 1, report
    poisoned = next(p for n, p in model.named_parameters() if n.endswith("wq.weight"))
    with torch.no_grad():
        poisoned[0, 0] = float("nan")
    with pytest.raises(RefitError) as info:
        refit(model, None, bucket_bytes=bucket_bytes, quantize=quantize, transport=sender,
              check_finite=True)  # fmt: skip
    assert info.value.non_finite, info.value


def _engine(quantize: str | None) -> None:  # the bucket size is the sender's business
    kw = dict(device="cuda:1", dtype=torch.bfloat16, quantize=quantize, max_batch_size=2)
    engine = Engine.from_model(make_model(CFG, seed=0), **kw)
    reference = make_model(CFG, seed=1)
    for step in range(STEPS):
        report = serve_refit(engine, src=0, engine_src=1)
        assert report is not None and report.version == engine.weight_version == step + 1
        step_weights(reference, step)
        direct = Engine.from_model(copy.deepcopy(reference).to("cuda:1"), **kw)
        for name, t in direct.committed.items():
            got = engine.committed[name]
            assert got.device == t.device and got.dtype == t.dtype, name
            assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
    before = {n: t.clone() for n, t in engine.committed.items()}
    with pytest.raises(RefitError):
        serve_refit(engine, src=0, engine_src=1)
    assert engine.weight_version == STEPS
    assert all(torch.equal(engine.committed[n].view(torch.uint8), t.view(torch.uint8))
               for n, t in before.items())  # fmt: skip


def _worker(rank: int, init_file: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank),
    )  # fmt: skip
    try:
        for quantize, bucket_bytes in CASES:
            if rank == 0:
                _trainer(quantize, bucket_bytes)
            else:
                _engine(quantize)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_nccl_broadcast_refit_across_two_gpus(tmp_path: Path) -> None:
    # spawn: CUDA cannot be used in a forked child of a process that initialised it
    mp.start_processes(_worker, args=(str(tmp_path / "init"),), nprocs=2, join=True,
                       start_method="spawn")  # fmt: skip
