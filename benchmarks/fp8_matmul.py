"""The engine's block-fp8 matmuls against bf16 cuBLAS, per projection shape and row count.

Legend: N output features, K input features (W [N, K]), rows: activation rows.

For each shape of a decoder layer (default: the h200-small trunk's fused qkv, wo, fused
gate/up and down) and each row count, device microseconds per call of: cuBLAS on the bf16
weight (what a bf16 engine runs at 5+ rows); `kernels.gemv` on the bf16 weight (1-4 rows);
`kernels.gemv` on the fp8 codes and block scales (1-4 rows); the fp8 x fp8 GEMM (quantize
the activation, then `fp8_matmul._fp8_gemm`) and the weight-only GEMM (`_fp8_gemm` on the
activation as it is, the codes widened in registers: one launch) at each BLOCK_Y of --block-y
(`fp8_matmul.CONFIG`; which of the two `fp8_linear` runs is CONFIG["WEIGHT_ONLY_ROWS"]); and
torch's blockwise `F.scaled_mm` (1x128 activation scales, 128x128 weight scales) where
this torch build runs it. COPIES distinct
weights are called in turn inside one CUDA graph, replayed (`common.graph_seconds`), so each
call streams its weight from HBM as a decode step's layers do. Errors are against the fp32
product of the dequantized weight (`fp8_matmul.fp8_linear_reference` for the fp8 x fp8 GEMM,
whose activation goes through e4m3).

  python benchmarks/fp8_matmul.py                 # ~1 minute on an H200
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import REPO_ROOT, graph_seconds, json_args, write_result

from birkhoff.engine.fp8 import FP8_BLOCK, dequantize_fp8_blockwise, quantize_fp8_blockwise
from birkhoff.kernels import fp8_matmul as FM
from birkhoff.kernels.gemv import MAX_ROWS, gemv

COPIES = 24
SHAPES = "2304x768,768x768,4096x768,768x2048"


def scaled_mm(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """torch's blockwise scaled matmul on our layouts: activation scales [rows, K / 128]
    column-major, the weight's as [K / 128, N / 128], K / 128 padded to a multiple of 4 (cuBLAS's
    layout; the padding is never read)."""
    qa, sa = FM.quantize_activation_cuda(x)
    k_blocks = s.shape[1]
    sw = s.new_zeros(s.shape[0], -(-k_blocks // 4) * 4)
    sw[:, :k_blocks] = s  # [N / 128, K / 128 padded]: passed transposed, strides (1, K padded)
    st = F.ScalingType
    return F.scaled_mm(qa, q.t(), sa.t().contiguous().t(), st.BlockWise1x128, sw.t(),
                       st.BlockWise128x128, output_dtype=x.dtype)  # fmt: skip


def timed(fn: Callable[[Any, Any], torch.Tensor], weights: list[Any], replays: int) -> float:
    return graph_seconds(lambda: [fn(*w) for w in weights], 1, replays=replays) * 1e6 / COPIES


def measure(rows: int, N: int, K: int, args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(N + K)
    x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    dense = [(torch.randn(N, K, device="cuda", generator=g) / K**0.5).bfloat16()
             for _ in range(COPIES)]  # fmt: skip
    fp8 = [quantize_fp8_blockwise(w, block=FP8_BLOCK) for w in dense]
    exact = F.linear(x.float(), dequantize_fp8_blockwise(*fp8[0], block=FP8_BLOCK).float())
    through_e4m3 = FM.fp8_linear_reference(x, *fp8[0]).float()
    fns: dict[str, tuple[Callable[..., torch.Tensor], list[Any], torch.Tensor]] = {
        "cublas_bf16": (lambda w: F.linear(x, w), [(w,) for w in dense], exact)
    }
    if rows <= MAX_ROWS:
        fns["gemv_bf16"] = (lambda w: gemv(x, w, None), [(w,) for w in dense], exact)
        fns["gemv_fp8"] = (lambda q, s: gemv(x, q, None, s, FP8_BLOCK), fp8, exact)
    default = dict(FM.CONFIG)
    out: dict[str, Any] = {}
    try:
        for by in args.block_y:
            FM.CONFIG.update(BLOCK_Y_FEW=by, BLOCK_Y=by)
            for name, quantize, want in (
                ("gemm_fp8", True, through_e4m3),
                ("gemm_w8", False, exact),
            ):
                run = functools.partial(FM.fp8_linear, x, quantize_input=quantize)
                out[f"{name}_y{by}_us"] = timed(run, fp8, args.replays)
                out[f"{name}_y{by}_err"] = (run(*fp8[0]).float() - want).abs().max().item()
    finally:
        FM.CONFIG.clear()
        FM.CONFIG.update(default)
    try:  # cuBLAS refuses some shapes and row counts: record why
        scaled_mm(x, *fp8[0])
        fns["scaled_mm"] = (lambda q, s: scaled_mm(x, q, s), fp8, through_e4m3)
    except (RuntimeError, ValueError) as e:
        out["scaled_mm_error"] = str(e).splitlines()[0][:200]
    for name, (fn, weights, want) in fns.items():
        out[f"{name}_us"] = timed(fn, weights, args.replays)
        out[f"{name}_err"] = (fn(*weights[0]).float() - want).abs().max().item()
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("--rows", type=ints, default=[1, 2, 4, 8, 16, 64, 256])
    p.add_argument("--shapes", default=SHAPES, help="NxK,...")
    p.add_argument("--block-y", type=ints, default=[16, 32, 64], help="fp8 GEMM tiles to time")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("times GPU matmuls: needs CUDA")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "calls": {},
                              "config": dict(FM.CONFIG)}  # fmt: skip
    layer: dict[int, dict[str, float]] = {}  # a layer's four projections, summed
    print(f"{'rows':>4} {'N x K':>10}  us per call of each matmul")
    with torch.no_grad():
        for rows in args.rows:
            for shape in args.shapes.split(","):
                N, K = (int(v) for v in shape.split("x"))
                r = measure(rows, N, K, args)
                result["calls"][f"{rows}/{shape}"] = r
                sums = layer.setdefault(rows, {})
                for k, v in r.items():
                    if k.endswith("_us"):
                        sums[k] = sums.get(k, 0.0) + v
                times = "  ".join(f"{k[:-3]} {v:.2f}" for k, v in r.items() if k.endswith("_us"))
                print(f"{rows:>4} {shape:>10}  {times}", flush=True)
    result["layer_us"] = {str(k): v for k, v in layer.items()}
    print("\na layer's four projections, us:")
    for rows, sums in layer.items():
        print(f"{rows:>4}  " + "  ".join(f"{k[:-3]} {v:.1f}" for k, v in sums.items()))
    result["args"] = json_args(args)
    out = args.out or REPO_ROOT / "benchmarks/results/fp8-matmul-cuda.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2, sort_keys=True)
    summary = {str(rows): {k[:-3]: round(v, 1) for k, v in sums.items()}
               for rows, sums in layer.items()}  # fmt: skip
    print(json.dumps({"layer_us": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
