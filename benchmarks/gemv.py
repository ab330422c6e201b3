"""The engine's few-row matmul (`kernels.gemv`) against cuBLAS (F.linear), in the same run.

Legend: N output features, K input features (W [N, K]), rows: activation rows.

For each projection shape of a decoder layer (default: the h200-small trunk's fused qkv, wo,
fused gate/up and down) and each row count, device microseconds per call: COPIES distinct
weights (more bytes than the L2 holds, so each call streams its weight from HBM, as a decode
step's layers do) called in turn inside one CUDA graph, replayed (`common.graph_seconds`). Also
the weight bytes over that time (GB/s), the error against the fp32 product, and which of the
two the engine's `linear` picks (`gemv.serves`).

  python benchmarks/gemv.py                 # rows 1-4
  python benchmarks/gemv.py --rows 1,2,3,4,5,8   # a batch-1 verify (J+1) and draft (J+k) chunk
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import REPO_ROOT, graph_seconds, json_args, write_result

from birkhoff.kernels.gemv import MAX_ROWS, gemv, serves

COPIES = 24
SHAPES = "2304x768,768x768,4096x768,768x2048"


def measure(rows: int, N: int, K: int, replays: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(N + K)
    x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    ws = [torch.randn(N, K, device="cuda", generator=g).bfloat16() for _ in range(COPIES)]
    fns: dict[str, Any] = {"cublas": lambda w: F.linear(x, w)}
    if rows <= MAX_ROWS:
        fns["gemv"] = lambda w: gemv(x, w, None)
    out: dict[str, Any] = {}
    want = F.linear(x.float(), ws[0].float())  # unscaled weights: errors relative to ~sqrt(K)
    for name, fn in fns.items():
        us = graph_seconds(lambda fn=fn: [fn(w) for w in ws], 1, replays=replays) * 1e6 / COPIES
        out[f"{name}_us"] = us
        out[f"{name}_gb_s"] = N * K * 2 / us / 1e3
        out[f"{name}_err"] = (fn(ws[0]).float() - want).abs().max().item()
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,2,3,4")
    p.add_argument("--shapes", default=SHAPES, help="NxK,...")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("times GPU matmuls: needs CUDA")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "calls": {}}
    # a decoder layer's projections per row count: cuBLAS alone, and what linear runs
    layer: dict[int, dict[str, float]] = {}
    head = ("rows", "N x K", "cuBLAS us", "gemv us", "ratio", "gemv GB/s", "linear")
    print("{:>4} {:>11} {:>10} {:>8} {:>6} {:>10} {:>7}".format(*head))
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            for shape in args.shapes.split(","):
                N, K = (int(v) for v in shape.split("x"))
                r = measure(rows, N, K, args.replays)
                r["linear_picks"] = "gemv" if serves(rows, N, K) else "cublas"
                result["calls"][f"{rows}/{shape}"] = r
                both = layer.setdefault(rows, {"cublas_us": 0.0, "linear_us": 0.0})
                both["cublas_us"] += r["cublas_us"]
                both["linear_us"] += r[f"{r['linear_picks']}_us"]
                line = f"{rows:>4} {shape:>11} {r['cublas_us']:>10.2f}"
                if "gemv_us" in r:
                    g = r["gemv_us"]
                    line += f" {g:>8.2f} {r['cublas_us'] / g:>5.2f}x {r['gemv_gb_s']:>10.0f}"
                print(f"{line} {r['linear_picks']:>7}")
    result["args"] = json_args(args)
    out = args.out or REPO_ROOT / "benchmarks/results/gemv-cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2)
    print(json.dumps({k: {n: round(t, 2) for n, t in v.items()} for k, v in layer.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
