"""Where the S=4 train step's extra time goes: device time per kernel, S=4 next to S=1.

Profiles one forward + loss + backward of `train_step.py`'s model (h200-small by default, bf16
autocast, no recompute) for each variant under torch.profiler, sums device time per kernel name
(names cut to 60 characters) and prints, per kernel, the milliseconds per step of every variant
and the difference to the first variant, largest difference first, then the totals next to the
wall time of the same steps: wall - device is time the GPU sat idle (launch or host bound).
Before that, per variant: the host time to issue one step next to its wall time, the ops with
the most host time (torch.profiler), with --python-profile N cProfile's N Python hotspots, and
the device's idle time in one step charged to the host op whose late launch ended each gap.

  python benchmarks/train_profile.py                          # S1_M1 vs S4_M1, h200-small
  python benchmarks/train_profile.py --variants S1_M0,S4_M0 --top 40
  python benchmarks/train_profile.py --compile --residual-dtype autocast   # as train_step's
  python benchmarks/train_profile.py --compile --residual-dtype autocast --cuda-graph
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import functools
import io
import itertools
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import write_result
from torch.profiler import ProfilerActivity, profile
from train_step import RESULTS, fwd_bwd, lm_loss, model_config, sizes

from birkhoff.model import Transformer
from birkhoff.model.hyper import apply_kernels
from birkhoff.train import TrainConfig
from birkhoff.train.graph import StepGraphs
from birkhoff.train.recompute import compile_blocks

Step = Callable[[], None]  # one forward + loss + backward of the profiled model


def host_and_wall_ms(step: Step) -> list[float]:
    """[host ms to issue one step, wall ms of the step]: equal when the host is the bound."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return [(issued - start) * 1e3, (time.perf_counter() - start) * 1e3]


def host_ops(step: Step, top: int) -> str:
    """The ops with the most host (self CPU) time in one step, as torch.profiler's table."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def python_hotspots(step: Step, top: int) -> str:
    """cProfile of one step: the Python functions with the most own time (where host time goes
    beyond the ops: wrappers, launchers, autograd glue)."""
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    torch.cuda.synchronize()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def idle_gaps(trace: dict[str, Any], top: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Where the device sat idle, from a torch.profiler chrome trace: every gap between two
    device activities is charged to the host op that launched the activity after the gap (its
    outermost and innermost op), if that launch came after the device had gone idle (the host
    was late); otherwise to "queued" (launched in time, started late). Returns (totals, the
    `top` (op, ms) charges)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    launch_at = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    ops = sorted(
        (e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"])
    )
    starts = [e["ts"] for e in ops]
    root, stack = [], []  # root[i]: the outermost op enclosing op i
    for i, e in enumerate(ops):
        while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] < e["ts"]:
            stack.pop()
        root.append(root[stack[0]] if stack else i)
        stack.append(i)

    def launcher(t: float) -> str:
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and ops[i]["ts"] + ops[i]["dur"] < t:
            i -= 1
        if i < 0:
            return "(no op)"
        outer, inner = ops[root[i]]["name"][:50], ops[i]["name"][:40]
        return outer if outer == inner else f"{outer} > {inner}"

    charges: dict[str, float] = defaultdict(float)
    totals = {"idle_ms": 0.0, "host_late_ms": 0.0, "queued_ms": 0.0}
    for prev, nxt in itertools.pairwise(device):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        if gap <= 0:
            continue
        totals["idle_ms"] += gap / 1e3
        t = launch_at.get(nxt.get("args", {}).get("correlation"))
        if t is not None and t > prev["ts"] + prev["dur"]:
            totals["host_late_ms"] += gap / 1e3
            charges[launcher(t)] += gap / 1e3
        else:
            totals["queued_ms"] += gap / 1e3
    return totals, sorted(charges.items(), key=lambda kv: -kv[1])[:top]


def idle_report(step: Step, top: int) -> str:
    """One profiled step's idle device time, charged to the host ops that were late."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    totals, charges = idle_gaps(trace, top)
    lines = [", ".join(f"{k} {v:.1f}" for k, v in totals.items())]
    lines += [f"  {ms:8.2f} ms  {name}" for name, ms in charges]
    return "\n".join(lines)


def profile_variant(name: str, args: argparse.Namespace) -> tuple[dict[str, float], float]:
    """(device ms per step of each kernel name, wall ms per step) of variant `name` (S4_M1);
    prints the host time to issue a step against its wall time, and the top host ops."""
    streams, mtp = (int(part[1:]) for part in name.split("_"))
    size = sizes(argparse.Namespace(**{**vars(args), "quick": False}))
    torch.manual_seed(0)
    cfg = model_config(size, streams, mtp, args.residual_dtype)
    model = apply_kernels(Transformer(cfg).cuda(), args.mhc_kernels)
    if args.compile:
        compile_blocks(model)
    ids_BT = torch.randint(0, model.cfg.vocab_size, (size["batch"], size["seq"]), device="cuda")
    train = TrainConfig(amp_dtype="bf16", cuda_graph=args.cuda_graph)
    graphs = StepGraphs(model, lm_loss, train) if args.cuda_graph else None
    step = functools.partial(fwd_bwd, model, ids_BT, train, graphs)
    for _ in range(3):
        step()
    host, wall = min(host_and_wall_ms(step) for _ in range(3))
    print(f"{name}: host issues a step in {host:.1f} ms, the step takes {wall:.1f} ms")
    print(host_ops(step, args.top_host))
    if args.python_profile:
        print(python_hotspots(step, args.python_profile))
    print(f"{name}: idle device time of one profiled step (host late = launched after idle)")
    print(idle_report(step, args.top_host))
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.repeats):
            step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / args.repeats
    per_name: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name[:60]] += event.device_time / 1e3 / args.repeats
    del model
    torch.cuda.empty_cache()
    return dict(per_name), wall_ms


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", default="S1_M1,S4_M1", help="first one is the baseline")
    p.add_argument("--mhc-kernels", choices=("auto", "eager", "triton"), default="auto")
    for flag in ("dim", "layers", "heads", "seq", "batch", "iters"):
        p.add_argument(f"--{flag}", type=int, default=None)
    p.add_argument("--residual-dtype", choices=("fp32", "autocast"), default="fp32")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--cuda-graph", action="store_true", help="the step replayed from a CUDA graph")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--top-host", type=int, default=15, help="host ops listed per variant")
    p.add_argument("--python-profile", type=int, default=0, help="list N cProfile hotspots")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("profiles device kernels: needs CUDA")
    args.device = "cuda"
    names = args.variants.split(",")
    times, walls = {}, {}
    for name in names:
        times[name], walls[name] = profile_variant(name, args)
    kernels = set().union(*times.values())
    base = names[0]
    rows = sorted(kernels, key=lambda k: -(times[names[-1]].get(k, 0) - times[base].get(k, 0)))
    print(f"{'kernel':<62}" + "".join(f"{n:>10}" for n in names) + f"{'diff':>10}")
    for k in rows[: args.top]:
        vals = [times[n].get(k, 0.0) for n in names]
        print(f"{k:<62}" + "".join(f"{v:>10.2f}" for v in vals) + f"{vals[-1] - vals[0]:>10.2f}")
    totals = {n: sum(times[n].values()) for n in names}
    print(f"{'device total (ms)':<62}" + "".join(f"{totals[n]:>10.2f}" for n in names))
    print(f"{'wall (ms)':<62}" + "".join(f"{walls[n]:>10.2f}" for n in names))
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "kernels_ms": times,
                              "device_ms": totals, "wall_ms": walls}  # fmt: skip
    out = args.out or RESULTS / "train_profile-cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2)
    print(json.dumps({"device_ms": totals, "wall_ms": walls}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
