"""Where a decode step's time goes: device time per kernel per step, for each model and batch.

Builds `decode.py`'s engines (the h200-small trunk as S=4, M=1 and S=1, M=0, random weights,
CUDA graphs), and for each batch profiles two greedy calls (new tokens N and N/2) under
torch.profiler; the difference of the two, divided by N/2, is one steady-state step (prefill,
admission and warm-up cancel). Prints per kernel name (cut to 60 characters, digits of template
sizes kept) the microseconds per step and launches per step of each model, largest first, then
the totals: kernels per step, device us per step (summed over kernels), busy us per step (time
at least one kernel runs: kernels on the side stream overlap), wall us per step, busy = busy
us / wall.
`--k K` profiles speculative steps (K drafts per verify) instead of plain ones.

  python benchmarks/decode_profile.py --batches 1,256            # both trunks
  python benchmarks/decode_profile.py --models S4-M1 --batches 1 --top 40
  python benchmarks/decode_profile.py --models S4-M1,S4-MoE --batches 1,64   # MoE vs dense
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from common import covered_us, json_args, same_active_moe, write_result
from decode import RESULTS, engine_for, task_batch, trunk
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from birkhoff.engine import Engine, SamplingParams

MODELS = {"S4-M1": (4, 1), "S1-M0": (1, 0), "S4-MoE": (4, 1)}  # S4-MoE: moe section of decode.py


def kernels_of(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """{kernel name: [device us, launches]} of one generate call, and its wall seconds."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    spans = []
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            per[event.name[:60]][0] += event.device_time
            per[event.name[:60]][1] += 1
            spans.append((event.time_range.start, event.time_range.end))
    return {"kernels": dict(per), "wall_s": wall, "busy_us": covered_us(spans)}


def best_wall(engine: Engine, prompts: list[list[int]], params: SamplingParams, reps: int) -> float:
    seconds = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        seconds = min(seconds, time.perf_counter() - start)
    return seconds


def step_profile(engine: Engine, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Per-step kernel table of steady-state decode at `batch` (see the module docstring)."""
    gen = torch.Generator().manual_seed(1)
    prompts = task_batch(batch, args.prompt_len, engine.cfg.vocab_size, gen).tolist()
    full = SamplingParams(args.new_tokens, num_speculative_tokens=args.k)
    short = SamplingParams(args.new_tokens // 2, num_speculative_tokens=args.k)
    engine.generate(prompts, full)  # warm-up: captures every graph the calls use
    long_run, short_run = kernels_of(engine, prompts, full), kernels_of(engine, prompts, short)
    steps = args.new_tokens - args.new_tokens // 2
    if args.k:  # speculative: count verify steps, not tokens
        engine.generate(prompts, full)
        stats = engine.last_stats
        steps = max(1, round(steps / max(stats.mean_accepted_length, 1.0))) if stats else steps
    wall = (best_wall(engine, prompts, full, args.repeats)
            - best_wall(engine, prompts, short, args.repeats)) / steps  # fmt: skip
    table = {}
    for name, (us, n) in long_run["kernels"].items():
        s_us, s_n = short_run["kernels"].get(name, (0.0, 0.0))
        table[name] = {"us": (us - s_us) / steps, "launches": (n - s_n) / steps}
    device_us = sum(v["us"] for v in table.values())
    busy_us = (long_run["busy_us"] - short_run["busy_us"]) / steps
    return {"batch": batch, "steps": steps, "wall_us": wall * 1e6, "device_us": device_us,
            "busy_us": busy_us, "busy": busy_us / max(wall * 1e6, 1e-9),
            "launches": sum(v["launches"] for v in table.values()), "kernels": table}  # fmt: skip


def print_tables(results: dict[str, list[dict[str, Any]]], top: int) -> None:
    names = list(results)
    for i, batch in enumerate(r["batch"] for r in results[names[0]]):
        rows = {m: results[m][i] for m in names}
        print(f"\n-- batch {batch}: us per step (launches per step)")
        print(f"{'kernel':60} " + " ".join(f"{m:>18}" for m in names))
        kernels = {k for r in rows.values() for k in r["kernels"]}
        order = sorted(kernels, key=lambda k: -max(r["kernels"].get(k, {"us": 0})["us"]
                                                   for r in rows.values()))  # fmt: skip
        for k in order[:top]:
            cells = []
            for m in names:
                v = rows[m]["kernels"].get(k, {"us": 0.0, "launches": 0.0})
                cells.append(f"{v['us']:10.1f} ({v['launches']:5.1f})")
            print(f"{k:60} " + " ".join(cells))
        for key in ("launches", "device_us", "busy_us", "wall_us", "busy"):
            print(f"{key:60} " + " ".join(f"{rows[m][key]:18.3f}" for m in names))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="S4-M1,S1-M0", help=f"comma list of {list(MODELS)}")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--k", type=int, default=0, help="speculative tokens (0: plain steps)")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--experts", type=int, default=32, help="routed experts of S4-MoE")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_profile.py needs CUDA (torch.profiler device time)", file=sys.stderr)
        return 2
    args.no_graphs, args.cb_max_new = False, args.new_tokens
    device, batches = torch.device("cuda"), [int(b) for b in args.batches.split(",")]
    results: dict[str, list[dict[str, Any]]] = {}
    for name in args.models.split(","):
        streams, mtp = MODELS[name]
        if args.k and not mtp:
            print(f"{name}: no MTP depth to draft with, skipped at --k {args.k}")
            continue
        extra = {"max_speculative_tokens": args.k} if args.k else {}
        cfg = trunk(args, streams, mtp)
        if name == "S4-MoE":  # not in the default list: --models S4-MoE
            cfg = same_active_moe(cfg, args.experts)
        engine = engine_for(cfg, args, device, max(batches), **extra)
        results[name] = [step_profile(engine, b, args) for b in batches]
        del engine
        torch.cuda.empty_cache()
    print_tables(results, args.top)
    out = args.out or RESULTS / f"decode-profile-cuda{'-k' + str(args.k) if args.k else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, {"args": json_args(args), "results": results}, indent=1)
    summary = {
        f"{m}_b{r['batch']}": {k: round(r[k], 3) for k in ("busy", "wall_us", "launches")}
        for m, rs in results.items()
        for r in rs
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
