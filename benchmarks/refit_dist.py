"""Refit across two GPUs: trainer on cuda:0, engine on cuda:1, buckets broadcast over NCCL.

Rows, all in one run (rank 0 times; a refit returns once the engine rank has checked and
committed, so its time is end to end):
  nccl_broadcast  one `dist.broadcast` of a buffer as large as the bf16 engine state: the
                  transport's ceiling
  peer_copy       `dst.copy_(src)` from cuda:0 to cuda:1 of the same bytes (NVLink)
  refit_<q>@<MB>  refit(model, None, transport=BroadcastSender) into a bf16 or fp8 engine
GB/s counts the bytes the engine ends up serving; ratios are against `nccl_broadcast`.

  python benchmarks/refit_dist.py                       # ~1.1B params, 256 MB and 1 GB buckets
  python benchmarks/refit_dist.py --dim 512 --layers 4  # quick
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import write_result

from birkhoff.config import ModelConfig
from birkhoff.engine import Engine
from birkhoff.model import Transformer
from birkhoff.refit import BroadcastSender, refit, serve_refit

RESULTS = Path(__file__).resolve().parent / "results"
WARMUP = 3  # the first refit makes the memoised bucket layout; the sender's bank is reused


def config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers,
                       num_heads=args.heads, num_streams=4, mtp_depth=1,
                       max_seq_len=128)  # fmt: skip


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `fn` (rank 0's view, device work included) after the warm-ups."""
    return common.timed(fn, "cuda", repeats, warmup=WARMUP)


def schedule(args: argparse.Namespace) -> list[tuple[str | None, float]]:
    return [(q, mb) for q in (None, "fp8") for mb in args.bucket_mb]


def measure_refit(
    model: Transformer,
    sender: BroadcastSender,
    quantize: str | None,
    bucket_bytes: int,
    args: argparse.Namespace,
) -> tuple[float, int]:
    """(median seconds, bytes served) of broadcast refits into the engine rank."""
    reports = []

    def once() -> None:
        reports.append(refit(model, None, bucket_bytes=bucket_bytes, quantize=quantize,
                             transport=sender))  # fmt: skip

    return timed(once, args.repeats), reports[-1].bytes


def measure_transfers(nbytes: int, repeats: int) -> dict[str, float]:
    """Seconds of one NCCL broadcast and of one peer copy of `nbytes` (freed on return)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(buffer, device="cuda:1")
    return {
        "nccl_broadcast": timed(lambda: dist.broadcast(buffer, src=0), repeats),
        "peer_copy": timed(lambda: dst.copy_(buffer), repeats),
    }


def trainer(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = Transformer(config(args))
    params = sum(p.numel() for p in model.parameters())  # a tied lm_head once
    dist.broadcast_object_list([params], src=0)
    rows = measure_transfers(2 * params, args.repeats)
    sender = BroadcastSender(src=0, engine_src=1, device="cuda:0")
    served = {}
    for quantize, mb in schedule(args):
        name = f"refit_{quantize or 'bf16'}@{mb:g}MB"
        rows[name], served[name] = measure_refit(model, sender, quantize, int(mb * 2**20), args)
    nbytes = {"nccl_broadcast": 2 * params, "peer_copy": 2 * params, **served}
    ceiling = nbytes["nccl_broadcast"] / rows["nccl_broadcast"]
    table = {name: {"seconds": s, "bytes": nbytes[name], "gb_per_s": nbytes[name] / s / 1e9,
                    "ratio_to_nccl_broadcast": nbytes[name] / s / ceiling}
             for name, s in rows.items()}  # fmt: skip
    return {"devices": [torch.cuda.get_device_name(i) for i in range(2)], "params": params,
            "args": common.json_args(args), "rows": table}  # fmt: skip


def engine_rank(args: argparse.Namespace) -> None:
    box = [0]
    dist.broadcast_object_list(box, src=0)
    params = box[0]
    buffer = torch.empty(2 * params, dtype=torch.uint8, device="cuda:1")
    for _ in range(WARMUP + args.repeats):
        dist.broadcast(buffer, src=0)
    del buffer
    for quantize, _ in schedule(args):
        engine = Engine(config(args), device="cuda:1", dtype=torch.bfloat16, quantize=quantize,
                        max_batch_size=1)  # fmt: skip
        for _ in range(WARMUP + args.repeats):
            serve_refit(engine, src=0, engine_src=1)


def worker(rank: int, args: argparse.Namespace, init_file: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(minutes=5),
                            device_id=torch.device("cuda", rank))  # fmt: skip
    try:
        if rank == 0:
            result = trainer(args)
            print_table(result)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_result(args.out, result, indent=2, sort_keys=True)
            print(f"wrote {args.out}")
        else:
            engine_rank(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{' + '.join(result['devices'])}: {result['params'] / 1e9:.3f}B params, fp32 trainer")
    print(f"{'row':<22}{'GB':>8}{'ms':>10}{'GB/s':>9}{'vs bcast':>10}")
    for name, r in result["rows"].items():
        print(f"{name:<22}{r['bytes'] / 1e9:>8.3f}{r['seconds'] * 1e3:>10.2f}{r['gb_per_s']:>9.1f}"
              f"{r['ratio_to_nccl_broadcast']:>10.3f}")  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[256, 1024])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS / "refit-dist-cuda.json")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        p.error(f"needs two CUDA devices, found {torch.cuda.device_count()}")
    init_file = f"/tmp/birkhoff-refit-dist-{time.time_ns()}"
    mp.start_processes(worker, args=(args, init_file), nprocs=2, join=True, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
