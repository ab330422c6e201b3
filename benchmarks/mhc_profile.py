"""Where the time of one fused mHC sublayer goes: device time per kernel, from torch.profiler.

Legend: B batch, T tokens, S streams, D model dim.

Runs the sublayer of `mhc_kernels.op_table` (as HyperConnection does: coefficients + mix in
as one op, F = identity, mix out), forward and backward, --repeats times under the profiler,
and prints each kernel's device time per call (microseconds) and its share of the sublayer's
device time, for the training shape (B x T tokens) and for decode-shaped calls (--decode-rows
tokens, forward only: what one engine step runs per sublayer). Kernel names are Triton's
(coeff_proj, coeff_tail, coeff_bwd, grad_x, grad_phi, mix_*) and torch's for the sums and adds
around them.

  python benchmarks/mhc_profile.py                               # B 8, T 2048, D 768, S 4, bf16
  python benchmarks/mhc_profile.py --decode-rows 1,64,256
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from common import json_args, write_result
from mhc_kernels import RESULTS, add_shape_args, make_inputs, op_table
from torch.profiler import ProfilerActivity, profile


def kernel_times(step: Any, repeats: int) -> dict[str, float]:
    """Device microseconds per call of each kernel name over `repeats` calls of `step`."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    per_name: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name[:60]] += event.device_time / repeats
    return dict(sorted(per_name.items(), key=lambda kv: -kv[1]))


def train_shape(args: argparse.Namespace) -> dict[str, float]:
    inp = make_inputs(args)
    leaves = [inp[k].requires_grad_(True) for k in ("x", "phi", "alpha", "bias")]
    sublayer = op_table(inp, args.iters)["sublayer"]

    def step() -> None:
        (out,) = sublayer("auto")
        torch.autograd.grad(out.float().sum(), leaves)

    return kernel_times(step, args.repeats)


def decode_shape(args: argparse.Namespace, rows: int) -> dict[str, float]:
    inp = make_inputs(argparse.Namespace(**{**vars(args), "batch": rows, "seq": 1}))
    sublayer = op_table(inp, args.iters)["sublayer"]

    def step() -> None:
        with torch.no_grad():
            sublayer("auto")

    return kernel_times(step, args.repeats)


def print_times(title: str, times: dict[str, float]) -> None:
    total = sum(times.values())
    print(f"\n{title}: {total:.1f} us of device time per sublayer")
    for name, us in times.items():
        print(f"  {name:<62}{us:>9.1f} us {us / total:>6.1%}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_shape_args(p)
    p.add_argument("--decode-rows", default="1,64,256", help="token counts of decode calls")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("profiles the fused kernels: needs CUDA")
    args.device = "cuda"
    result: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    result["train_fwd_bwd"] = train_shape(args)
    print_times(f"fwd+bwd, B {args.batch} T {args.seq}", result["train_fwd_bwd"])
    for rows in (int(r) for r in args.decode_rows.split(",")):
        result[f"decode_{rows}"] = decode_shape(args, rows)
        print_times(f"decode forward, {rows} tokens", result[f"decode_{rows}"])
    result["args"] = json_args(args)
    out = args.out or RESULTS / f"mhc_profile-cuda-{args.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2)
    totals = {k: v for k, v in result.items() if k.startswith(("train", "decode"))}
    print(json.dumps({k: round(sum(v.values()), 1) for k, v in totals.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
