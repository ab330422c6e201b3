"""Routed-expert computation: the loop over experts vs sorted tokens + grouped GEMMs.

Both paths of birkhoff.model.moe run the same routed pairs (T tokens, top-R of E experts,
routed by random affinities) forward + backward; reported per path: median time, routed
tokens/s, achieved TFLOP/s (6 * 3 * D * F FLOPs per routed pair: gate, up and down projections,
forward + backward) and the grouped/loop speed-up, measured in the same run, with the largest
difference of the two outputs. A dense SwiGLU of the same active width (R * F) over the same
T tokens is timed alongside as the reference a grouped GEMM competes with.

  python benchmarks/moe_experts.py --device cpu --quick     # smoke run, seconds (fp32)
  python benchmarks/moe_experts.py --device cuda            # H200: bf16, E=64, R=6, D=2048
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import timed, write_result

from birkhoff.model.moe import experts_grouped, experts_loop, select_experts, swiglu

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {
    "quick": dict(tokens=256, experts=8, topk=2, dim=64, hidden=32, repeats=3),
    "cpu": dict(tokens=2048, experts=16, topk=2, dim=256, hidden=128, repeats=5),
    "cuda": dict(tokens=16384, experts=64, topk=6, dim=2048, hidden=1024, repeats=20),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true")
    for name in ("tokens", "experts", "topk", "dim", "hidden", "repeats"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args()
    for key, value in SIZES["quick" if args.quick else args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main() -> None:
    args = parse_args()
    dev, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    T, E, R, D, F = args.tokens, args.experts, args.topk, args.dim, args.hidden
    g = torch.Generator().manual_seed(0)
    scores_TE = torch.rand(T, E, generator=g)
    idx_TR, gates_TR = select_experts(scores_TE, torch.zeros(E), R)
    x_TD = (torch.randn(T, D, generator=g) * 0.5).to(dev, dtype).requires_grad_()
    w_gate_up = (torch.randn(E, 2 * F, D, generator=g) * 0.02).to(dev, dtype).requires_grad_()
    w_down = (torch.randn(E, D, F, generator=g) * 0.02).to(dev, dtype).requires_grad_()
    dense_up = (torch.randn(2 * R * F, D, generator=g) * 0.02).to(dev, dtype).requires_grad_()
    dense_down = (torch.randn(D, R * F, generator=g) * 0.02).to(dev, dtype).requires_grad_()
    idx_TR, gates_TR = idx_TR.to(dev), gates_TR.to(dev)
    runs = {
        "loop": lambda: experts_loop(x_TD, idx_TR, gates_TR, w_gate_up, w_down),
        "grouped": lambda: experts_grouped(x_TD, idx_TR, gates_TR, w_gate_up, w_down),
        "dense_same_active": lambda: swiglu(x_TD, dense_up, dense_down),
    }
    outs = {name: fn().detach().float() for name, fn in runs.items() if name != "dense_same_active"}
    flops = 6 * 3 * D * F * T * R
    rows = {}
    for name, fn in runs.items():
        seconds = timed(
            lambda f=fn: f().float().square().sum().backward(), dev, args.repeats, warmup=2
        )
        rows[name] = {
            "ms": seconds * 1e3,
            "tokens_per_s": T / seconds,
            "tflops": flops / seconds / 1e12,
        }
    print(f"{'path':<20}{'ms':>10}{'tokens/s':>14}{'TFLOP/s':>10}")
    for name, row in rows.items():
        print(f"{name:<20}{row['ms']:>10.3f}{row['tokens_per_s']:>14.0f}{row['tflops']:>10.2f}")
    report = {
        "bench": "moe_experts",
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "sizes": {"T": T, "E": E, "R": R, "D": D, "F": F},
        "paths": rows,
        "grouped_over_loop_speedup": rows["loop"]["ms"] / rows["grouped"]["ms"],
        "grouped_over_dense_time": rows["grouped"]["ms"] / rows["dense_same_active"]["ms"],
        "max_abs_diff": float((outs["grouped"] - outs["loop"]).abs().max()),
    }
    suffix = "-quick" if args.quick else ""
    out = args.out or RESULTS / f"moe_experts-{dev}{suffix}.json"
    repo = RESULTS.parent.parent
    out_path = out.resolve()
    report["out"] = str(out_path.relative_to(repo) if out_path.is_relative_to(repo) else out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, report, device=args.device, indent=2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
