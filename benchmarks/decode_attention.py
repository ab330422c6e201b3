"""Launch-parameter sweep of the engine's decode attention (`birkhoff::decode_attention`).

Legend: A rows, T query tokens per row (1: a plain decode step), H = G heads (h200-small: 12 of
64 dims), N cache positions, ctx the live prefix each row attends over.

For each shape and each variant of `kernels.attention.CONFIG` (keys per block BN, num_warps,
num_stages), of `kernels.attention.HEADS` (the T = 1 kernel's kv heads a program HB, key columns
a block BN, num_warps, num_stages, timed at every row count; HB 0 sends T = 1 to the CONFIG
kernel) and of the split size SPLIT, times --calls back-to-back calls of the op (with --rope,
`decode_attention_rope`, what a decode step runs) captured in
one CUDA graph (device time only: a decode step replays it from a graph too; timing the Python
launches instead measures the host at small shapes), checks the output against the default's,
and reports the live K/V bytes per second against a device copy measured in the same run.
Prints a table of the default and the fastest variants per shape, then a JSON line.

  python benchmarks/decode_attention.py                  # a few minutes on an H200
  TRITON_INTERPRET=1 python benchmarks/decode_attention.py --device cpu --shapes 2:20 \
      --heads 2 --bn 16 --warps 1 --stages 1 --hb 2 --splits 256 --calls 1 --out /tmp/attn.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import copy_bandwidth, graph_seconds, json_args, write_result
from mhc_kernels import RESULTS

from birkhoff.kernels import attention


def device_seconds(fn: Callable[[], Any], calls: int, device: str) -> float:
    """Seconds per call of `fn`: `calls` calls in one CUDA graph, replayed (CPU: plain calls)."""
    fn()  # compiles the variant
    if device == "cuda":
        return graph_seconds(fn, calls)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def shape_inputs(A: int, ctx: int, heads: int, device: str, rope: bool) -> dict[str, Any]:
    """A decode step's attention inputs; with rope, `decode_attention_rope`'s (the token's raw
    q, k and v and its angles: the kernel rotates them and writes k and v into the cache)."""
    N, K = max(128, 1 << (ctx - 1).bit_length()), 64
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(A, heads, N, K, generator=g, device=device, dtype=dt)
    inp = dict(
        q_ATHK=torch.randn(A, 1, heads, K, generator=g, device=device, dtype=dt), k_BGNK=k,
        v_BGNK=torch.randn(k.shape, generator=g, device=device, dtype=dt),
        rows_A=torch.arange(A, device=device, dtype=torch.int32),
        positions_AT=torch.full((A, 1), ctx - 1, device=device, dtype=torch.int64),
        valid_AT=torch.ones((A, 1), device=device, dtype=torch.bool), limit=N,
    )  # fmt: skip
    if not rope:
        return inp
    new = torch.randn(2, A, 1, heads, K, generator=g, device=device, dtype=dt)
    theta = torch.rand(A, 1, K // 2, generator=g, device=device, dtype=torch.float64) * ctx
    return dict(
        q_A1HK=inp["q_ATHK"], k_A1GK=new[0], v_A1GK=new[1], cos_A1K2=theta.cos(),
        sin_A1K2=theta.sin(), k_BGNK=k, v_BGNK=inp["v_BGNK"], rows_A=inp["rows_A"],
        positions_A1=inp["positions_AT"], valid_A1=inp["valid_AT"], limit=N,
    )  # fmt: skip


def _set(config: dict[str, int], heads: dict[str, int], split: int) -> None:
    for table, values in ((attention.CONFIG, config), (attention.HEADS, heads)):
        table.clear()
        table.update(values)
    attention.SPLIT = split


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    copy = copy_bandwidth(args.device, 10)
    default = dict(attention.CONFIG), dict(attention.HEADS), attention.SPLIT
    tiles = list(itertools.product(args.bn, args.warps, args.stages))
    off = dict(default[1], HB=0)
    variants = [(dict(BN=bn, num_warps=w, num_stages=st), off, split)
                for split in args.splits for bn, w, st in tiles]  # fmt: skip
    variants += [(default[0], dict(HB=hb, BN=bn, num_warps=w, num_stages=st, PAIRS=0), split)
                 for split in args.splits for hb in args.hb for bn, w, st in tiles
                 if bn % hb == 0]  # fmt: skip
    op = attention.decode_attention_rope if args.rope else attention.decode_attention
    rows = []
    for shape in args.shapes.split(","):
        A, ctx = (int(v) for v in shape.split(":"))
        inp = shape_inputs(A, ctx, args.heads, args.device, args.rope)
        live_bytes = 2 * A * args.heads * ctx * 64 * inp["k_BGNK"].element_size()
        ref = op(**inp)
        call = functools.partial(op, **inp)
        for config, heads, split in [default, *variants]:
            _set(config, heads, split)
            try:
                seconds = device_seconds(call, args.calls, args.device)
                diff = (call().float() - ref.float()).abs().max().item()
            finally:
                _set(*default)
            rows.append(dict(A=A, ctx=ctx, split=split, **config, heads=heads, us=seconds * 1e6,
                             diff=diff, of_copy=live_bytes / seconds / copy,
                             default=(config, heads, split) == default))  # fmt: skip
    return dict(
        copy_gb_s=copy / 1e9,
        rope=args.rope,
        rows=rows,
        default=dict(default[0], HEADS=default[1], SPLIT=default[2]),
    )


def print_sweep(result: dict[str, Any], top: int) -> None:
    print(f"device copy {result['copy_gb_s']:.0f} GB/s; default {result['default']}")
    shapes = sorted({(r["A"], r["ctx"]) for r in result["rows"]})
    for A, ctx in shapes:
        rows = [r for r in result["rows"] if (r["A"], r["ctx"]) == (A, ctx)]
        base = next(r for r in rows if r["default"])
        print(f"\nA {A} ctx {ctx}: default {base['us']:.1f} us ({base['of_copy']:.2f} of copy)")
        for r in sorted(rows, key=lambda r: r["us"])[:top]:
            h = r["heads"]
            tile = (f"BN {r['BN']:4} warps {r['num_warps']} stages {r['num_stages']}"
                    if not h["HB"] else f"HB {h['HB']} BN {h['BN']:4} warps {h['num_warps']} "
                    f"stages {h['num_stages']}")  # fmt: skip
            print(f"  split {r['split']:4} {tile}: {r['us']:8.1f} us  {r['of_copy']:.2f} of copy  "
                  f"x{base['us'] / r['us']:.2f}  diff {r['diff']:.1e}")  # fmt: skip


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shapes", default="1:88,64:88,256:88,256:400,64:2000", help="A:ctx,...")
    p.add_argument("--heads", type=int, default=12)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("--bn", type=ints, default=[32, 64, 128])
    p.add_argument("--warps", type=ints, default=[1, 2, 4])
    p.add_argument("--stages", type=ints, default=[2, 3])
    p.add_argument("--hb", type=ints, default=[2, 4, 8], help="T = 1 kernel's heads a program")
    p.add_argument("--splits", type=ints, default=[256, 512])
    p.add_argument("--calls", type=int, default=20, help="op calls per timed CUDA graph")
    p.add_argument("--rope", action="store_true",
                   help="time decode_attention_rope (a decode step's op) instead")  # fmt: skip
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    result = sweep(args)
    print_sweep(result, args.top)
    result["args"] = json_args(args)
    out = args.out or RESULTS / f"decode_attention-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, device=args.device, indent=2, sort_keys=True)
    best: dict[str, float] = {}  # fastest us per shape
    for r in result["rows"]:
        key = f"{r['A']}:{r['ctx']}"
        best[key] = min(best.get(key, r["us"]), r["us"])
    print(json.dumps({k: round(us, 1) for k, us in best.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
