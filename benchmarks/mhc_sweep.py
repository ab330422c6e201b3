"""Launch-parameter sweep of the fused mHC kernels: which CONFIG entry is fastest on this GPU.

Legend: B batch, T tokens, S streams, D model dim.

For the default `birkhoff.kernels.mhc.configs.CONFIG` and then each variant of `SWEEP` (one
CONFIG entry replaced at a time), times the fused ops that the replaced entry launches, forward
and forward + backward, at the h200-small shape (B 8, T 2048, S 4, D 768, bf16 by default).
Each figure is the mean of --repeats calls captured in one CUDA graph and replayed between two
CUDA events (device time only; `--timing launch`: Python-launched calls back to back, which at
these sizes moved ops a variant does not touch by up to +-50%), after a warm-up that also
compiles the variant. "of copy" sets the op's compulsory traffic per second against a
device-to-device copy measured in the same run. Every variant's outputs and gradients are
checked against the default's (max |difference| relative to max |default|, printed; ~1e-7
expected: the variants change tiles and launch shapes, "tf32" variants change the dot
precision, ~1e-3).
The summary names, per CONFIG key, the variant with the smallest summed time over its ops, and
prints the CONFIG that results; copy it into kernels/mhc/configs.py.

  python benchmarks/mhc_sweep.py                    # ~2 minutes on an H200
  python benchmarks/mhc_sweep.py --dtype fp32       # the "_fp32" entries and the shared ones
  TRITON_INTERPRET=1 python benchmarks/mhc_sweep.py --device cpu --batch 1 --seq 8 --dim 16 \
      --repeats 1 --out /tmp/sweep.json            # smoke test of the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import copy_bandwidth, graph_seconds, json_args, write_result
from mhc_kernels import (
    RESULTS,
    add_shape_args,
    compulsory_bytes,
    make_inputs,
    op_table,
)
from torch import Tensor

from birkhoff.kernels.mhc import configs as mhc_configs

OPS_OF_KEY = {  # CONFIG key -> (op, backward) pairs whose time it changes
    "coeff_proj": [("coefficients", False), ("coefficients", True), ("sublayer", False)],
    "coeff_tail": [("coefficients", False), ("coefficients", True), ("sublayer", False)],
    "coeff_bwd": [("coefficients", True)],
    "grad_x": [("coefficients", True)],
    "grad_phi": [("coefficients", True)],
    "coeff_proj_fp32": [("coefficients", False), ("coefficients", True), ("sublayer", False)],
    "grad_phi_fp32": [("coefficients", True)],
    "mix": [("mix_in", False), ("mix_in", True), ("mix_out", False), ("mix_out", True)],
}
SUBLAYER = [("sublayer", False), ("sublayer", True)]


def back_to_back(step: Callable[[], Any], repeats: int, timing: str = "launch") -> float:
    """Mean seconds per call of `repeats` calls (after 3 warm-up calls): captured in one CUDA
    graph and replayed (`timing="graph"`: device time only), or queued back to back from
    Python ("launch": the host's launch cost included where it is the bound). A step that
    cannot be captured falls back to "launch", with a note on stderr."""
    for _ in range(3):
        step()
    if timing == "graph" and torch.cuda.is_available():
        try:
            return graph_seconds(step, repeats)
        except Exception as error:  # noqa: BLE001 (any capture failure: time it launched)
            torch.cuda.synchronize()
            print(f"capture failed ({type(error).__name__}: {error}); timing launched calls",
                  file=sys.stderr)  # fmt: skip
    if not torch.cuda.is_available():  # the interpreter smoke test on CPU
        start_s = time.perf_counter()
        for _ in range(repeats):
            step()
        return (time.perf_counter() - start_s) / repeats
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def outputs(fn: Callable[[str], list[Tensor]], leaves: list[Tensor]) -> list[Tensor]:
    outs = fn("triton")
    loss = sum(o.float().sum() for o in outs)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [t.detach().float() for t in (*outs, *grads) if t is not None]


def time_ops(
    pairs: list[tuple[str, bool]], table: dict[str, Callable[[str], list[Tensor]]],
    leaves: list[Tensor], repeats: int, timing: str,
) -> dict[str, float]:  # fmt: skip
    def step(name: str, backward: bool) -> Callable[[], None]:
        def run() -> None:
            if not backward:
                with torch.no_grad():
                    table[name]("triton")
                return
            loss = sum(o.float().sum() for o in table[name]("triton"))
            torch.autograd.grad(loss, leaves, allow_unused=True)

        return run

    return {f"{n} {'fwd+bwd' if b else 'fwd'}": back_to_back(step(n, b), repeats, timing)
            for n, b in pairs}  # fmt: skip


def launched(key: str, dtype: str, config: dict[str, Any]) -> bool:
    """Whether the ops launch CONFIG[key] on `dtype` streams (as `mhc.configs.launch` picks): an
    "_fp32" entry on fp32 streams only; any other entry on other streams, and on fp32 streams
    where it has no "_fp32" twin."""
    if key.endswith("_fp32"):
        return dtype == "fp32"
    return dtype != "fp32" or f"{key}_fp32" not in config


def max_rel_diff(got: list[Tensor], want: list[Tensor]) -> float:
    return max(((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
               for g, w in zip(got, want, strict=True))  # fmt: skip


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    inp = make_inputs(args)
    for t in inp.values():
        t.requires_grad_(True)
    leaves = list(inp.values())
    table = op_table(inp, args.iters)
    copy = copy_bandwidth(args.device, 10)
    default = dict(mhc_configs.CONFIG)
    pairs = sorted({p for ps in OPS_OF_KEY.values() for p in ps} | set(SUBLAYER))
    reference = {n: outputs(table[n], leaves) for n in table}
    base = time_ops(pairs, table, leaves, args.repeats, args.timing)
    rows = [dict(variant="default", key="", ms=base, diff=0.0)]
    for variant, override in mhc_configs.SWEEP.items():
        (key,) = override
        if args.only and not any(part in variant for part in args.only.split(",")):
            continue
        if not launched(key, args.dtype, default):
            continue
        mhc_configs.CONFIG.update(override)
        try:
            ops = sorted({n for n, _ in OPS_OF_KEY[key]} | {"sublayer"})
            diff = max(max_rel_diff(outputs(table[n], leaves), reference[n]) for n in ops)
            ms = time_ops(sorted(set(OPS_OF_KEY[key] + SUBLAYER)), table, leaves, args.repeats,
                          args.timing)  # fmt: skip
        finally:
            mhc_configs.CONFIG.clear()
            mhc_configs.CONFIG.update(default)
        rows.append(dict(variant=variant, key=key, ms=ms, diff=diff))
    for row in rows:
        row["ms"] = {op: 1e3 * s for op, s in row["ms"].items()}
        row["of_copy"] = {
            op: compulsory_bytes(op.split()[0], inp, op.endswith("bwd")) / (ms / 1e3) / copy
            for op, ms in row["ms"].items()
        }
    return dict(copy_gb_s=copy / 1e9, rows=rows, best=best_config(rows, default))


def best_config(rows: list[dict[str, Any]], default: dict[str, Any]) -> dict[str, Any]:
    """Per CONFIG key: the variant (or "default") with the smallest summed time of its ops."""
    best: dict[str, Any] = {}
    base = rows[0]["ms"]
    for key, pairs in OPS_OF_KEY.items():
        if not any(r["key"] == key for r in rows[1:]):
            continue
        ops = [f"{n} {'fwd+bwd' if b else 'fwd'}" for n, b in pairs]
        choices = [("default", sum(base[o] for o in ops))] + [
            (r["variant"], sum(r["ms"][o] for o in ops)) for r in rows[1:] if r["key"] == key
        ]
        name, total = min(choices, key=lambda c: c[1])
        entry = default[key] if name == "default" else mhc_configs.SWEEP[name][key]
        best[key] = dict(variant=name, ms=total, default_ms=choices[0][1], entry=entry)
    return best


def print_sweep(result: dict[str, Any]) -> None:
    print(f"device copy {result['copy_gb_s']:.0f} GB/s; ms per call (fraction of copy bandwidth)")
    for row in result["rows"]:
        cells = "  ".join(
            f"{op} {ms:.3f} ({row['of_copy'][op]:.2f})" for op, ms in row["ms"].items()
        )
        print(f"{row['variant']:<28} diff {row['diff']:.1e}  {cells}")
    print("best per CONFIG key:")
    for key, b in result["best"].items():
        print(f"  {key:<10} {b['variant']:<28} {b['ms']:.3f} ms (default {b['default_ms']:.3f})")
    config = dict(mhc_configs.CONFIG) | {k: b["entry"] for k, b in result["best"].items()}
    print("CONFIG =", json.dumps(config))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a smoke test under TRITON_INTERPRET=1 with tiny shapes",
    )
    add_shape_args(p)
    p.add_argument("--only", default="", help="comma list: sweep variants whose name has one")
    p.add_argument("--timing", choices=("graph", "launch"), default="graph",
                   help="graph: calls replayed from a CUDA graph (device time); "
                        "launch: Python-launched calls back to back")  # fmt: skip
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu runs the kernels under the interpreter: set TRITON_INTERPRET=1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    result = sweep(args)
    print_sweep(result)
    result["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result["args"] = json_args(args)
    out = args.out or RESULTS / f"mhc_sweep-cuda-{args.dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2, sort_keys=True)
    print(json.dumps({k: v for k, v in result.items() if k not in ("args", "rows")}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
