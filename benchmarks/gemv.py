"""The engine's one-row matmul (`kernels.gemv`) against cuBLAS (F.linear), in the same run.

Legend: N output features, K input features (W [N, K]), rows: activation rows.

For each projection shape of a decoder layer (default: the h200-small trunk's fused qkv, wo,
fused gate/up and down) and each row count, device microseconds per call: COPIES distinct
weights (more bytes than the L2 holds, so each call streams its weight from HBM, as a decode
step's layers do) called in turn inside one CUDA graph, replayed (`common.graph_seconds`). Also
the weight bytes over that time (GB/s) and the error against the fp32 product.

  python benchmarks/gemv.py                 # rows 1, 2, 3 (gemv serves one row)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import REPO_ROOT, graph_seconds, json_args

from birkhoff.kernels.gemv import gemv

COPIES = 24
SHAPES = "2304x768,768x768,4096x768,768x2048"


def measure(rows: int, N: int, K: int, replays: int) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(N + K)
    x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    ws = [torch.randn(N, K, device="cuda", generator=g).bfloat16() for _ in range(COPIES)]
    fns: dict[str, Any] = {"cublas": lambda w: F.linear(x, w)}
    if rows == 1:
        fns["gemv"] = lambda w: gemv(x, w, None)
    out: dict[str, float] = {}
    want = F.linear(x.float(), ws[0].float())  # unscaled weights: errors relative to ~sqrt(K)
    for name, fn in fns.items():
        us = graph_seconds(lambda fn=fn: [fn(w) for w in ws], 1, replays=replays) * 1e6 / COPIES
        out[f"{name}_us"] = us
        out[f"{name}_gb_s"] = N * K * 2 / us / 1e3
        out[f"{name}_err"] = (fn(ws[0]).float() - want).abs().max().item()
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,2,3")
    p.add_argument("--shapes", default=SHAPES, help="NxK,...")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("times GPU matmuls: needs CUDA")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "calls": {}}
    head = ("rows", "N x K", "cuBLAS us", "gemv us", "ratio", "gemv GB/s")
    print("{:>4} {:>11} {:>10} {:>8} {:>6} {:>10}".format(*head))
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            for shape in args.shapes.split(","):
                N, K = (int(v) for v in shape.split("x"))
                r = measure(rows, N, K, args.replays)
                result["calls"][f"{rows}/{shape}"] = r
                line = f"{rows:>4} {shape:>11} {r['cublas_us']:>10.2f}"
                if "gemv_us" in r:
                    g = r["gemv_us"]
                    line += f" {g:>8.2f} {r['cublas_us'] / g:>5.2f}x {r['gemv_gb_s']:>10.0f}"
                print(line)
    result["args"] = json_args(args)
    out = args.out or REPO_ROOT / "benchmarks/results/gemv-cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    ones = [v for k, v in result["calls"].items() if k.startswith("1/")]
    print(json.dumps({"rows1_cublas_us": round(sum(v["cublas_us"] for v in ones), 2),
                      "rows1_gemv_us": round(sum(v["gemv_us"] for v in ones), 2)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
