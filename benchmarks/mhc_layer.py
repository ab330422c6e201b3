"""mHC at the layer level: S=4 vs S=1 forward+backward per block and per step, at several widths.

For each dim (default 768 = h200-small, 2048, 4096; same tokens per step) a shallow model of
`--blocks` blocks runs three variants: S1 (plain pre-norm residual), S4 (the fused mHC kernels
beside the GEMMs) and S4_fold (the mixes folded into the GEMMs: TrainConfig.fold_gemms). It
times the block stack's forward+backward (per layer = stack / blocks) and the whole shallow
model's step (embedding, blocks, contraction, head, loss), reports S4/S1 for both, profiles one
stack pass per variant (CUDA: every kernel's device time; for the stream kernels their
bandwidth over their compulsory stream bytes against the copy rate measured in the same run),
and puts the HBM floor of each design (bytes around the GEMMs, at copy rate) and the GEMM floor
(FLOPs at the measured matmul rate) next to the measured time. One JSON per dim in
benchmarks/results/ (`sizes.dim`, `ratios.mhc_S4_over_S1_*`). `--quick`: tiny CPU smoke run
(with TRITON_INTERPRET=1 and `--mhc-kernels triton` the fused and folded ops run too).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, sync, timed, write_result  # noqa: E402

from birkhoff.config import ModelConfig  # noqa: E402
from birkhoff.kernels import use_fused  # noqa: E402
from birkhoff.model import Transformer, hyper  # noqa: E402
from birkhoff.model.block import apply_fold  # noqa: E402
from birkhoff.presets import h200_small  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {"S1": (1, False), "S4": (4, False), "S4_fold": (4, True)}  # name: (streams, fold)
# compulsory [T,S,D] stream passes of each stream kernel (reads + writes); [T,D] and weight
# traffic left out, so the bandwidth below is a lower bound
STREAM_PASSES = {
    "coeff_proj": 1, "grad_x": 3, "grad_phi": 1, "mix_in_fwd": 1, "mix_in_bwd": 2,
    "mix_out_fwd": 2, "mix_out_bwd": 3, "mix_norm_fwd": 1, "mix_norm_bwd": 1,
}  # fmt: skip
# per sublayer, forward + backward: (stream passes P = T*S*D, [T,D] passes Q = T*D) moved
# around the GEMMs by each design as built (docs/mhc.md counts them)
TRAFFIC = {"S1": (0, 13), "S4": (10, 13), "S4_fold": (10, 9)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one iteration")
    p.add_argument("--dims", default=None, help="comma-separated (cuda: 768,2048,4096)")
    p.add_argument("--blocks", type=int, default=None, help="blocks of the stack (cuda: 2)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--streams-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: ModelConfig.residual_dtype='autocast'")  # fmt: skip
    p.add_argument("--mhc-kernels", choices=("auto", "eager", "triton"), default="auto")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--no-profile", action="store_true", help="skip the per-kernel table")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    return p.parse_args()


def sizes(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        base = dict(dims="32", blocks=1, seq=16, batch=2, iters=1)
    elif args.device == "cuda":
        base = dict(dims="768,2048,4096", blocks=2, seq=2048, batch=8, iters=10)
    else:
        base = dict(dims="128", blocks=2, seq=64, batch=2, iters=3)
    return {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}


def model_config(
    dim: int, streams: int, size: dict[str, Any], args: argparse.Namespace
) -> ModelConfig:
    small = h200_small().model
    heads = small.num_heads if dim == small.dim else max(2, dim // 128)
    vocab = 64 if args.quick else small.vocab_size
    residual = "autocast" if args.streams_dtype == "bf16" else "fp32"
    return ModelConfig(
        vocab_size=vocab, dim=dim, num_layers=size["blocks"], num_heads=heads,
        num_streams=streams, mtp_depth=0, max_seq_len=size["seq"],
        residual_dtype=residual,  # type: ignore[arg-type]
    )  # fmt: skip


def autocast(device: torch.device) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def stack_pass(model: Transformer, x_BTSD: torch.Tensor, g_BTSD: torch.Tensor) -> None:
    """Forward + backward of the block stack alone (streams in, streams out)."""
    rope = model.rope(x_BTSD.shape[1], x_BTSD.device)
    with autocast(x_BTSD.device):
        y_BTSD = x_BTSD
        for block in model.blocks:
            y_BTSD = block(y_BTSD, rope)
    y_BTSD.backward(g_BTSD)
    for p in model.parameters():
        p.grad = None
    x_BTSD.grad = None


def step_pass(model: Transformer, ids_BT: torch.Tensor) -> None:
    """Forward + backward of the whole shallow model's loss."""
    with autocast(ids_BT.device):
        out = model(ids_BT, labels=ids_BT)
    assert out.loss is not None
    out.loss.backward()
    for p in model.parameters():
        p.grad = None


def kernel_table(fn: Any, device: torch.device) -> dict[str, dict[str, float]]:
    """{kernel name: {calls, us}} of one call of `fn` (CUDA device time, torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    table: dict[str, dict[str, float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        row = table.setdefault(e.name, {"calls": 0, "us": 0.0})
        row["calls"] += 1
        row["us"] += float(getattr(e, "device_time", 0.0) or getattr(e, "cuda_time", 0.0))
    return table


def bandwidths(table: dict[str, dict[str, float]], stream_bytes: float, copy: float) -> None:
    """Add each stream kernel's GB/s over its compulsory stream bytes and its copy fraction."""
    for name, row in table.items():
        passes = STREAM_PASSES.get(name)
        if passes is not None and row["us"] > 0:
            rate = passes * stream_bytes * row["calls"] / (row["us"] * 1e-6)
            row.update(gbps=rate / 1e9, of_copy=rate / copy)


def floors(model: Transformer, name: str, shape: tuple[int, int], args: argparse.Namespace,
           rates: dict[str, float]) -> dict[str, float | None]:  # fmt: skip
    """Per layer: the HBM floor (TRAFFIC's bytes + 3 passes over the bf16 weights, at the copy
    rate) and the GEMM floor (6 FLOPs per weight and token, causal attention, at the matmul
    rate; None without a measured rate)."""
    cfg = model.cfg
    tokens, seq = shape[0] * shape[1], shape[1]
    stream_bytes = 2 if args.streams_dtype == "bf16" else 4
    P, Q = TRAFFIC[name]
    weights = sum(m.weight.numel() for m in model.blocks[0].modules()
                  if isinstance(m, torch.nn.Linear))  # fmt: skip
    hbm = 2 * (P * tokens * cfg.num_streams * cfg.dim * stream_bytes + Q * tokens * cfg.dim * 2)
    hbm += 3 * 2 * weights
    flops = 6 * tokens * weights + 6 * tokens * seq * cfg.dim
    matmul = rates.get("matmul")
    return {
        "hbm_floor_ms": 1e3 * hbm / rates["copy"],
        "gemm_floor_ms": 1e3 * flops / matmul if matmul else None,
        "hbm_bytes": float(hbm),
        "flops": float(flops),
    }


def run_variant(dim: int, name: str, size: dict[str, Any], args: argparse.Namespace,
                device: torch.device, rates: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    streams, fold_on = VARIANTS[name]
    torch.manual_seed(0)
    cfg = model_config(dim, streams, size, args)
    model = apply_fold(hyper.apply_kernels(Transformer(cfg).to(device), args.mhc_kernels), fold_on)
    shape = (size["batch"], size["seq"])
    dtype = torch.bfloat16 if args.streams_dtype == "bf16" and device.type == "cuda" else None
    x = torch.randn(*shape, streams, dim, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    ids = torch.randint(0, cfg.vocab_size, shape, device=device)
    iters, warmup = size["iters"], 1 if args.quick else 2
    layer = timed(lambda: stack_pass(model, x, g), device, iters, warmup=warmup) / cfg.num_layers
    step = timed(lambda: step_pass(model, ids), device, iters, warmup=warmup)
    row: dict[str, Any] = dict(
        streams=streams,
        folded=fold_on and streams > 1 and use_fused(x, args.mhc_kernels),
        layer_ms=1e3 * layer,
        step_ms=1e3 * step,
        **floors(model, name, shape, args, rates),
    )
    if device.type == "cuda" and not args.no_profile:
        table = kernel_table(lambda: stack_pass(model, x, g), device)
        bandwidths(table, shape[0] * shape[1] * streams * dim * x.element_size(), rates["copy"])
        row["kernels"] = table
    return row


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """S4 / S1 time ratios (> 1: slower) per layer and per step, unfolded and folded."""
    out: dict[str, float] = {}
    for name, tag in (("S4", ""), ("S4_fold", "_fold")):
        if name in rows and "S1" in rows:
            for unit in ("layer", "step"):
                out[f"mhc_S4_over_S1_{unit}{tag}"] = (
                    rows[name][f"{unit}_ms"] / rows["S1"][f"{unit}_ms"]
                )
    return out


def print_table(dim: int, rows: dict[str, dict[str, Any]]) -> None:
    print(f"\ndim {dim}")
    print(f"{'variant':<9} {'layer ms':>9} {'step ms':>9} {'HBM floor':>10} {'GEMM floor':>11}")
    for name, r in rows.items():
        gemm = r["gemm_floor_ms"]
        gemm_s = f"{gemm:11.3f}" if gemm is not None else f"{'-':>11}"
        print(f"{name:<9} {r['layer_ms']:9.3f} {r['step_ms']:9.3f} {r['hbm_floor_ms']:10.3f} "
              f"{gemm_s}")  # fmt: skip
    for name, r in rows.items():
        for kernel, k in sorted(r.get("kernels", {}).items(), key=lambda kv: -kv[1]["us"])[:12]:
            bw = f"{k['gbps']:8.0f} GB/s {k['of_copy']:5.2f} of copy" if "gbps" in k else ""
            print(f"  {name:<8} {kernel[:48]:<48} {int(k['calls']):4d} {k['us']:9.1f} us {bw}")


def measure_rates(device: torch.device, quick: bool) -> dict[str, float]:
    """The copy rate (bytes/s, read + write) and, on CUDA, the bf16 matmul rate (FLOP/s)."""
    rates = {"copy": copy_bandwidth(device, repeats=3 if quick else 20,
                                    num_bytes=1 << (20 if quick else 30))}  # fmt: skip
    if device.type == "cuda":
        n = 8192
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        rates["matmul"] = 2 * n**3 / timed(lambda: a @ a, device, 10, warmup=3)
    return rates


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    device, size = torch.device(args.device), sizes(args)
    wanted = args.variants.split(",")
    if unknown := sorted(set(wanted) - set(VARIANTS)):
        raise SystemExit(f"--variants: unknown {unknown}")
    rates = measure_rates(device, args.quick)
    print(f"device={args.device} {size} streams={args.streams_dtype} "
          f"kernels={args.mhc_kernels} copy={rates['copy'] / 1e9:.0f} GB/s "
          f"interpret={os.environ.get('TRITON_INTERPRET') == '1'}")  # fmt: skip
    for dim in (int(d) for d in str(size["dims"]).split(",")):
        rows = {name: run_variant(dim, name, size, args, device, rates) for name in wanted}
        print_table(dim, rows)
        overhead = ratios(rows)
        for key, value in overhead.items():
            print(f"{key:<28} {value:.3f}x")
        report = dict(device=args.device, torch=torch.__version__, sizes=dict(size, dim=dim),
                      streams_dtype=args.streams_dtype, mhc_kernels=args.mhc_kernels,
                      rates=rates, variants=rows, ratios=overhead)  # fmt: skip
        if device.type == "cuda":
            report["gpu"] = torch.cuda.get_device_name(device)
        suffix = f"-d{dim}-{args.streams_dtype}" + ("-quick" if args.quick else "")
        out = args.out_dir / f"mhc_layer-{args.device}{suffix}.json"
        write_result(out, report, device=args.device, indent=2)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
