"""The engine's tiled matmul (`kernels.matmul`) against cuBLAS (F.linear), in the same run.

Legend: N output features, K input features (W [N, K]), rows: activation rows; a tile is
BMxBNxBKxWARPSxSTAGES.

For each projection shape of a decoder layer (default: the h200-small trunk's fused qkv, wo,
fused gate/up and down), each row count and each tile, device microseconds per call: COPIES
distinct weights (more bytes than the L2 holds, so each call streams its weight from HBM, as a
decode step's layers do) called in turn inside one CUDA graph, replayed
(`common.graph_seconds`). The gate/up shape is timed as the engine runs it: cuBLAS then
`silu_mul`, against the tiled matmul with its SwiGLU epilogue. Per row count the table gives
cuBLAS's layer sum, each shape's best tile, and the one tile with the best layer sum (what a
`matmul.CONFIG` row class holds); the last line is JSON.

  python benchmarks/matmul.py --rows 16,64,128,256 --tiles 64x32x64x4x4,64x64x64x4x3
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

from birkhoff.kernels import matmul as MM
from birkhoff.kernels.norm_rope import silu_mul

COPIES = 24
SHAPES = "2304x768,768x768,4096x768,768x2048"
GATE_UP = "4096x768"
TILES = ",".join(
    f"{bm}x{bn}x{bk}x{w}x{s}"
    for bm, bn in ((64, 32), (64, 64), (64, 128), (128, 32), (128, 64), (128, 128))
    for bk, w, s in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (64, 8, 3))
)


def tile(spec: str) -> dict[str, int]:
    bm, bn, bk, warps, stages = (int(v) for v in spec.split("x"))
    return dict(BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)


def measure(rows: int, N: int, K: int, tiles: list[str], replays: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(N + K)
    x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    ws = [(torch.randn(N, K, device="cuda", generator=g) / K**0.5).bfloat16()
          for _ in range(COPIES)]  # fmt: skip
    swiglu = f"{N}x{K}" == GATE_UP
    fns: dict[str, Any] = {
        "cublas": (lambda w: silu_mul(F.linear(x, w))) if swiglu else (lambda w: F.linear(x, w))
    }
    for spec in tiles:
        cfg = tile(spec)
        fns[spec] = lambda w, cfg=cfg: MM.launch(x, w, None, swiglu, cfg)
    want = fns["cublas"](ws[0]).float()
    out: dict[str, Any] = {}
    for name, fn in fns.items():
        try:
            us = graph_seconds(lambda fn=fn: [fn(w) for w in ws], 1, replays=replays)
        except Exception as e:  # a tile that does not compile (shared memory): skipped
            print(f"  {rows}/{N}x{K} {name}: {type(e).__name__}", file=sys.stderr)
            continue
        err = (fn(ws[0]).float() - want).abs().max().item()
        out[name] = {"us": us * 1e6 / COPIES, "err": err}
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="16,64,128,256")
    p.add_argument("--shapes", default=SHAPES, help="NxK,...")
    p.add_argument("--tiles", default=TILES)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("times GPU matmuls: needs CUDA")
    tiles, shapes = args.tiles.split(","), args.shapes.split(",")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "calls": {}, "layer": {}}
    print(f"{'rows':>4} {'N x K':>10} {'cuBLAS us':>10} {'best tile':>16} {'us':>7} {'ratio':>6}")
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            calls = {s: measure(rows, *(int(v) for v in s.split("x")), tiles, args.replays)
                     for s in shapes}  # fmt: skip
            for s, r in calls.items():
                result["calls"][f"{rows}/{s}"] = r
                best = min((t for t in r if t != "cublas"), key=lambda t: r[t]["us"])
                c, b = r["cublas"]["us"], r[best]["us"]
                print(f"{rows:>4} {s:>10} {c:>10.2f} {best:>16} {b:>7.2f} {c / b:>5.2f}x")
            sums = {t: sum(calls[s][t]["us"] for s in shapes)
                    for t in ["cublas", *tiles] if all(t in calls[s] for s in shapes)}  # fmt: skip
            best = min((t for t in sums if t != "cublas"), key=sums.__getitem__)
            result["layer"][rows] = {"cublas_us": sums["cublas"], "tile": best,
                                     "tile_us": sums[best]}  # fmt: skip
            print(f"{rows:>4} {'layer':>10} {sums['cublas']:>10.2f} {best:>16} "
                  f"{sums[best]:>7.2f} {sums['cublas'] / sums[best]:>5.2f}x")  # fmt: skip
    result["args"] = json_args(args)
    out = args.out or REPO_ROOT / "benchmarks/results/matmul-cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({r: {k: v if isinstance(v, str) else round(v, 2) for k, v in d.items()}
                      for r, d in result["layer"].items()}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
