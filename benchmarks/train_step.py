"""Training throughput: forward + backward tokens/s for S=1 vs S=4 streams and M=0 vs M=1 MTP.

Four variants at equal dims (dim, layers, heads, batch, seq): (S, M) in {(1,0), (4,0), (1,1),
(4,1)}; (1,0) is a plain pre-norm transformer. One timed iteration is forward + loss + backward
(no optimizer step: its cost is per parameter, not per token, and nearly equal across variants),
run under the same `forward_context` as the training step (bf16 autocast on CUDA). Reported
per variant: median step time, tokens/s, peak memory (CUDA), achieved TFLOP/s and, on CUDA, MFU;
and the overhead ratios S=4/S=1 (mHC) and M=1/M=0 (MTP), all measured in the same run.

FLOPs per token (stated, PaLM-style): 6 * N_matmul + 12 * L_attn * T * D, where
  N_matmul = every parameter except the input embedding, plus M * V * D because the shared
             lm_head runs once more per MTP depth (mHC `phi` projections are included; the
             Sinkhorn iterations and stream mixing are not model FLOPs and show up as overhead),
  L_attn   = num_layers + M (each MTP depth has one attention block),
  12*T*D   = QK^T and AV, forward + backward, counted without the causal half (as PaLM does).
MFU = achieved FLOP/s / peak, with the peak taken both as the bf16 matmul rate measured in this
run (8192^3, best of 10) and as the 790 TFLOP/s measured on an H200.

  python benchmarks/train_step.py --device cpu --quick      # smoke run, seconds
  python benchmarks/train_step.py --device cpu              # small model, a few minutes
  python benchmarks/train_step.py --device cuda             # h200-small preset: ~120M, T=2048
  python benchmarks/train_step.py --device cuda --compile   # same, each block torch.compiled
  python benchmarks/train_step.py --device cuda --compile --cuda-graph  # and fwd+bwd graphed
  python benchmarks/train_step.py --device cuda --moe       # MoE vs dense of equal active params

MoE (--moe, or variant names ending in `_moe`): the same trunk with MoE feed-forwards in every
layer but the first and in the MTP depth (`common.same_active_moe`: one shared + top-3 of
--experts routed experts, each a quarter of the dense width), so its active parameters per
token equal the dense model's; its FLOPs count only the active experts ((E-3)/E of every
stacked expert tensor is left out of N_matmul, the router is counted). `moe_over_dense_*` is
the time ratio against the dense variant of the same (S, M).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import same_active_moe, sync, write_result

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer
from birkhoff.model.hyper import apply_kernels
from birkhoff.model.moe import moe_layers
from birkhoff.presets import h200_small
from birkhoff.train import TrainConfig, forward_context
from birkhoff.train.graph import StepGraphs
from birkhoff.train.recompute import apply_recompute, compile_blocks

VARIANTS = ((1, 0), (4, 0), (1, 1), (4, 1))  # (S, M)
H200_BF16_PEAK = 790e12
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few iterations")
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--iters", type=int, default=None, help="timed iterations per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--recompute", choices=("none", "full"), default="none")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="forward + backward from a CUDA graph (TrainConfig.cuda_graph)",
    )
    p.add_argument("--mhc-kernels", choices=("auto", "eager", "triton"), default="auto",
                   help="mHC ops: fused Triton (auto on CUDA) or the eager reference")  # fmt: skip
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated (default S1_M0,S4_M0,S1_M1,S4_M1; --moe: S4_M1,S4_M1_moe)",
    )
    p.add_argument("--residual-dtype", choices=("fp32", "autocast"), default="fp32",
                   help="the streams' dtype under autocast (ModelConfig)")  # fmt: skip
    p.add_argument("--moe", action="store_true", help="MoE vs dense of equal active parameters")
    p.add_argument("--experts", type=int, default=None, help="routed experts (32; quick: 4)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: results/)")
    args = p.parse_args()
    if args.compile and args.recompute == "full":
        p.error("--compile with --recompute full is not supported (TrainConfig.compile)")
    if args.cuda_graph and (args.recompute == "full" or args.device != "cuda"):
        p.error("--cuda-graph needs --device cuda and --recompute none (TrainConfig.cuda_graph)")
    return args


def sizes(args: argparse.Namespace) -> dict[str, int]:
    """Defaults per device; explicit flags win. CUDA defaults are the h200-small preset's."""
    if args.device == "cuda":
        m = h200_small().model
        base = dict(dim=m.dim, layers=m.num_layers, heads=m.num_heads, seq=2048, batch=8, iters=10)
    elif args.quick:
        base = dict(dim=64, layers=2, heads=4, seq=64, batch=2, iters=2)
    else:
        base = dict(dim=256, layers=4, heads=4, seq=256, batch=4, iters=5)
    given = {k: getattr(args, k) for k in base if getattr(args, k) is not None}
    return base | given


def model_config(
    size: dict[str, int], streams: int, mtp: int, residual: str = "fp32"
) -> ModelConfig:
    return ModelConfig(
        vocab_size=h200_small().model.vocab_size, dim=size["dim"], num_layers=size["layers"],
        num_heads=size["heads"], num_streams=streams, mtp_depth=mtp, max_seq_len=size["seq"],
        residual_dtype=residual,  # type: ignore[arg-type]
    )  # fmt: skip


def inactive_params(model: Transformer) -> int:
    """Routed-expert parameters a token does not use: (E-k)/E of every stacked expert tensor."""
    total = 0
    for _, layer in moe_layers(model):
        E, k = layer.moe.num_experts, layer.moe.experts_per_token
        total += (layer.experts.w_gate_up.numel() + layer.experts.w_down.numel()) * (E - k) // E
    return total


def flops_per_token(model: Transformer, seq: int) -> float:
    cfg = model.cfg
    num_matmul = sum(p.numel() for n, p in model.named_parameters() if n != "embed.weight")
    num_matmul += cfg.mtp_depth * cfg.vocab_size * cfg.dim - inactive_params(model)
    return 6.0 * num_matmul + 12.0 * (cfg.num_layers + cfg.mtp_depth) * seq * cfg.dim


def lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    out = model(batch[0], labels=batch[0])
    assert out.loss is not None
    return out.loss, {}


def fwd_bwd(model: Transformer, ids_BT: torch.Tensor, train: TrainConfig,
            graphs: StepGraphs | None = None) -> None:  # fmt: skip
    if graphs is not None:
        graphs((ids_BT,))
    else:
        with forward_context(model, train):
            loss, _ = lm_loss(model, (ids_BT,))
        loss.backward()
    for p in model.parameters():
        p.grad = None


def time_variant(model: Transformer, ids_BT: torch.Tensor, args: argparse.Namespace,
                 iters: int) -> tuple[float, int]:  # fmt: skip
    """(median seconds per fwd+bwd, peak bytes allocated during the timed iterations)."""
    device = ids_BT.device
    train = TrainConfig(amp_dtype="bf16" if device.type == "cuda" else "none",
                        recompute=args.recompute, cuda_graph=args.cuda_graph)  # fmt: skip
    graphs = StepGraphs(model, lm_loss, train) if args.cuda_graph else None
    if graphs is not None:  # the peak then includes the graph's pool, allocated at capture
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        fwd_bwd(model, ids_BT, train, graphs)
    sync(device)
    if device.type == "cuda" and graphs is None:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fwd_bwd(model, ids_BT, train, graphs)
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return statistics.median(times), peak


def measure_matmul_peak(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """Best bf16 matmul FLOP/s of an n^3 product on this device (CUDA only)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(reps + 2):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def run_variant(size: dict[str, int], streams: int, mtp: int, args: argparse.Namespace,
                device: torch.device, *, moe: bool = False) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(0)
    cfg = model_config(size, streams, mtp, args.residual_dtype)
    experts = args.experts or (4 if args.quick else 32)
    model = Transformer(same_active_moe(cfg, experts) if moe else cfg).to(device)
    apply_kernels(model, args.mhc_kernels)
    if args.recompute == "full":  # every block and MTP depth, safe reclaim
        apply_recompute(model, reclaim="safe")
    if args.compile:
        compile_blocks(model)
    gen = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(0, model.cfg.vocab_size, (size["batch"], size["seq"]), generator=gen)
    seconds, peak = time_variant(model, ids_BT.to(device), args, size["iters"])
    tokens = size["batch"] * size["seq"]
    flops = flops_per_token(model, size["seq"]) * tokens / seconds
    num_params = sum(p.numel() for p in model.parameters())
    result = dict(streams=streams, mtp=mtp, moe=moe, num_params=num_params,
                  active_params=num_params - inactive_params(model), step_ms=1e3 * seconds,
                  tokens_per_s=tokens / seconds, tflops=flops / 1e12,
                  peak_gib=peak / 2**30)  # fmt: skip
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


RATIOS = {  # name: (slower variant, baseline variant)
    "mhc_S4_over_S1_M0": ("S4_M0", "S1_M0"),
    "mhc_S4_over_S1_M1": ("S4_M1", "S1_M1"),
    "mtp_M1_over_M0_S1": ("S1_M1", "S1_M0"),
    "mtp_M1_over_M0_S4": ("S4_M1", "S4_M0"),
    "both_S4M1_over_S1M0": ("S4_M1", "S1_M0"),
}


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Time ratios (> 1 = slower) at equal dims, from tokens/s measured in this run."""
    tps = {k: v["tokens_per_s"] for k, v in rows.items()}
    pairs = RATIOS | {f"moe_over_dense_{k}": (f"{k}_moe", k) for k in tps if not k.endswith("_moe")}
    return {name: tps[base] / tps[slow] for name, (slow, base) in pairs.items()
            if slow in tps and base in tps}  # fmt: skip


def print_table(rows: dict[str, dict[str, Any]], peaks: dict[str, float]) -> None:
    mfu_cols = list(peaks)
    header = (
        f"{'variant':<12}{'params':>12}{'active':>12}{'step ms':>10}{'tokens/s':>12}{'TFLOP/s':>9}"
    )
    header += f"{'peak GiB':>10}" + "".join(f"{'MFU@' + k:>14}" for k in mfu_cols)
    print(header)
    for name, r in rows.items():
        line = f"{name:<12}{r['num_params']:>12,}{r['active_params']:>12,}"
        line += f"{r['step_ms']:>10.1f}{r['tokens_per_s']:>12,.0f}"
        line += f"{r['tflops']:>9.2f}{r['peak_gib']:>10.2f}"
        line += "".join(f"{r['mfu'][k]:>14.1%}" for k in mfu_cols)
        print(line)


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)
    device, size = torch.device(args.device), sizes(args)
    peaks: dict[str, float] = {}
    if device.type == "cuda":
        peaks = {"measured": measure_matmul_peak(device), "790T": H200_BF16_PEAK}
    default = "S4_M1,S4_M1_moe" if args.moe else "S1_M0,S4_M0,S1_M1,S4_M1"
    wanted = (args.variants or default).split(",")
    known = {f"S{s}_M{m}{tag}": (s, m, tag == "_moe") for s, m in VARIANTS for tag in ("", "_moe")}
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}")
    rows = {name: run_variant(size, s, m, args, device, moe=moe)
            for name, (s, m, moe) in known.items() if name in wanted}  # fmt: skip
    for r in rows.values():
        r["mfu"] = {k: r["tflops"] * 1e12 / peak for k, peak in peaks.items()}
    print(f"device={args.device} sizes={size} recompute={args.recompute} compile={args.compile} "
          f"cuda_graph={args.cuda_graph} residual={args.residual_dtype} "
          f"mhc_kernels={args.mhc_kernels} torch={torch.__version__}")  # fmt: skip
    print_table(rows, peaks)
    overhead = ratios(rows)
    for name, value in overhead.items():
        print(f"{name:<22} {value:.3f}x time")
    report = dict(device=args.device, torch=torch.__version__, sizes=size,
                  recompute=args.recompute, compile=args.compile, cuda_graph=args.cuda_graph,
                  residual_dtype=args.residual_dtype, threads=torch.get_num_threads(),
                  mhc_kernels=args.mhc_kernels, experts=args.experts or (4 if args.quick else 32),
                  peak_flops=peaks, variants=rows, ratios=overhead,
                  flops_formula="6*N_matmul + 12*(num_layers+M)*T*D per token")  # fmt: skip
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    suffix = ("-moe" if args.moe else "") + ("-compile" if args.compile else "")
    suffix += "-graph" if args.cuda_graph else ""
    suffix += ("-quick" if args.quick else "") + ("-eager" if args.mhc_kernels == "eager" else "")
    out = args.out or RESULTS / f"train_step-{args.device}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, report, device=args.device, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
