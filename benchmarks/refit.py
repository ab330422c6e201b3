"""Refit throughput (GB/s of served weights) next to the device's own copy bandwidth, same run.

Rows, all on the same trainer model and device:
  copy         `dst.copy_(src)` of one buffer as large as the bf16 engine state: the ceiling
  refit_bf16   refit() into a bf16 engine (buckets -> session -> atomic commit)
  refit_fp8    refit() into an engine serving block-fp8 matmul weights (+ fp32 scales)
  from_model   `Engine.from_model`: a new engine's first load (fresh tensors, no buckets)
GB/s counts the bytes the engine ends up serving (bf16: 2 per parameter; fp8: ~1 per matmul
parameter), divided by the wall time of the whole call, host syncs included (one per refit).
Ratios are against `copy`; the bf16 target is >= 0.30. Trainer weights are fp32 (master
weights) unless --trainer-dtype bf16.

  python benchmarks/refit.py --device cpu --quick
  python benchmarks/refit.py --device cpu [--threads 1]
  python benchmarks/refit.py --device cuda            # ~1.1B params (dim 2048, 18 layers, M=1)
  python benchmarks/refit.py --device cuda --bucket-mb 64 256 1024
  python benchmarks/refit.py --device cuda --moe      # the same trunk with MoE layers

--moe: MoE feed-forwards in every layer but the first and in the MTP depth
(`common.same_active_moe`: one shared + top-3 of --experts routed experts, a quarter of the dense
width each), so the stacked expert tensors ([E, 2F, D], [E, D, F]) dominate the bytes; fp8
quantizes every expert's 128x128 blocks, and the router stays fp32.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import torch
from common import add_size_args, apply_sizes, json_args, same_active_moe, write_result

from birkhoff.config import ModelConfig
from birkhoff.engine import Engine
from birkhoff.model import Transformer
from birkhoff.refit import refit

RESULTS = Path(__file__).resolve().parent / "results"


# A refit into an engine reaches its steady state on the third call: the first two make its two
# banks of bucket memory (then reused in turn); the memoised bucket layout is made on the first.
WARMUP = 3


def timed(fn: Callable[[], Any], device: str, repeats: int) -> float:
    return common.timed(fn, device, repeats, warmup=WARMUP)


def build_model(args: argparse.Namespace) -> Transformer:
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, num_layers=args.layers,
                      num_heads=args.heads, num_streams=args.streams, mtp_depth=args.mtp,
                      max_seq_len=128)  # fmt: skip
    if args.moe:
        cfg = same_active_moe(cfg, args.experts)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Transformer(cfg)
    return model.to(torch.bfloat16 if args.trainer_dtype == "bf16" else torch.float32)


def served_bytes(engine: Engine) -> int:
    return sum(t.numel() * t.element_size() for t in engine.weights.values())


def row(nbytes: int, seconds: float, params: int, **extra: Any) -> dict[str, Any]:
    return {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
            "gparams_per_s": params / seconds / 1e9, **extra}  # fmt: skip


def measure_copy(nbytes: int, params: int, args: argparse.Namespace) -> dict[str, Any]:
    src = torch.empty(nbytes, dtype=torch.uint8, device=args.device).random_()
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), args.device, args.repeats)
    return row(nbytes, seconds, params)


def measure_refit(model: Transformer, args: argparse.Namespace, quantize: str | None,
                  bucket_mb: float) -> dict[str, Any]:  # fmt: skip
    engine = Engine(model.cfg, device=args.device, dtype=torch.bfloat16, quantize=quantize,
                    max_batch_size=1)  # fmt: skip
    bucket_bytes = int(bucket_mb * 2**20)
    reports = []

    def once() -> None:
        reports.append(refit(model, engine, bucket_bytes=bucket_bytes, quantize=quantize))

    seconds = timed(once, args.device, args.repeats)
    out = row(served_bytes(engine), seconds, count_params(model), bucket_mb=bucket_mb,
              num_buckets=reports[-1].num_buckets, version=engine.weight_version)  # fmt: skip
    return out


def measure_from_model(model: Transformer, args: argparse.Namespace) -> dict[str, Any]:
    engines = []

    def once() -> None:
        engines[:] = [Engine.from_model(model, device=args.device, dtype=torch.bfloat16,
                                        max_batch_size=1)]  # fmt: skip

    seconds = timed(once, args.device, args.repeats)
    return row(served_bytes(engines[0]), seconds, count_params(model))


def count_params(model: Transformer) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied lm_head once


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(args)
    params = count_params(model)
    rows: dict[str, dict[str, Any]] = {"copy": measure_copy(2 * params, params, args)}
    for mb in args.bucket_mb:
        for quantize in (None, "fp8"):
            name = f"refit_{quantize or 'bf16'}" + (f"@{mb:g}MB" if len(args.bucket_mb) > 1 else "")
            rows[name] = measure_refit(model, args, quantize, mb)
            free(args.device)
    rows["from_model"] = measure_from_model(model, args)
    copy_bw = rows["copy"]["gb_per_s"]
    for r in rows.values():
        r["ratio_to_copy"] = r["gb_per_s"] / copy_bw
    return {"device": device_name(args.device), "params": params, "args": vars(args), "rows": rows}


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['device']}: {result['params'] / 1e9:.3f}B params, "
          f"trainer {result['args']['trainer_dtype']}")  # fmt: skip
    print(f"{'row':<22}{'GB':>8}{'ms':>10}{'GB/s':>9}{'Gparam/s':>10}{'vs copy':>9}{'buckets':>9}")
    for name, r in result["rows"].items():
        print(f"{name:<22}{r['bytes'] / 1e9:>8.3f}{r['seconds'] * 1e3:>10.1f}{r['gb_per_s']:>9.2f}"
              f"{r['gparams_per_s']:>10.3f}{r['ratio_to_copy']:>9.3f}"
              f"{r.get('num_buckets', ''):>9}")  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_size_args(p)
    p.add_argument("--bucket-mb", type=float, nargs="+")
    p.add_argument("--trainer-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--moe", action="store_true", help="MoE layers (common.same_active_moe)")
    p.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer")
    args = p.parse_args(argv)
    sizes = {
        "cuda": dict(dim=2048, layers=18, heads=16, vocab=32768, bucket_mb=[256], repeats=5),
        "cpu": dict(dim=512, layers=8, heads=8, vocab=8192, bucket_mb=[4], repeats=5),
        "quick": dict(dim=64, layers=2, heads=4, vocab=256, bucket_mb=[1], repeats=2),
    }
    apply_sizes(args, sizes)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    print_table(result)
    suffix = ("-moe" if args.moe else "") + ("-quick" if args.quick else "")
    out = args.out or RESULTS / f"refit-{args.device}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result["args"] = json_args(args)
    write_result(out, result, device=args.device, indent=2, sort_keys=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
