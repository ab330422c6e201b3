"""Which dtype the residual streams should have: the same supervised run with fp32 and bf16 streams.

Trains a preset's model (default h200-small) from the same seed and the same batches once per
`--dtypes` entry (`ModelConfig.residual_dtype`: "fp32" or "autocast" = bf16 under autocast) and
records, side by side: the main and MTP loss curves, the step time, the held-out teacher-forced
exact match at the end, and every `--probe-every` steps the largest deviation of H_res's row and
column sums from 1 over every mHC sublayer on a fixed probe batch (Sinkhorn's doubly-stochastic
constraint as the trained model sees it in that dtype). Writes JSON (and optionally a plot).

    python benchmarks/stream_dtype.py --device cuda --steps 2000
    python benchmarks/stream_dtype.py --quick          # CPU, tiny-cpu, a few steps
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from common import REPO_ROOT, json_args, write_result

from birkhoff.model.hyper import HyperConnection, mhc_coefficients
from birkhoff.presets import get_preset
from birkhoff.tasks.batches import batch_for_step
from birkhoff.tasks.problems import get_task, held_out_rng, sample_problems
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train.loop import supervised_steps, teacher_forced_accuracy
from birkhoff.train.optim import build_optimizer
from birkhoff.train.recompute import build_model
from birkhoff.train.step import forward_context


def h_res_deviation(model: torch.nn.Module, batch: Any, train_cfg: Any) -> dict[str, float]:
    """Max |row sum - 1| and |column sum - 1| of H_res over every mHC sublayer and token."""
    streams: list[tuple[HyperConnection, torch.Tensor]] = []

    def capture(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        streams.append((module, args[0].detach()))  # type: ignore[arg-type]

    hooks = [
        m.register_forward_pre_hook(capture)
        for m in model.modules()
        if isinstance(m, HyperConnection)
    ]
    try:
        with torch.no_grad(), forward_context(model, train_cfg):
            model(batch.input_ids, labels=batch.input_ids, loss_mask=batch.loss_mask)
    finally:
        for hook in hooks:
            hook.remove()
    rows = cols = 0.0
    for module, x_BTSD in streams:
        with torch.no_grad():
            _, _, h_res = mhc_coefficients(
                x_BTSD, module.phi, module.alpha, module.bias,
                iters=module.iters, norm_eps=module.norm_eps, eps=module.eps, kernels="eager",
            )  # fmt: skip
        rows = max(rows, float((h_res.sum(-1) - 1).abs().max()))
        cols = max(cols, float((h_res.sum(-2) - 1).abs().max()))
    return {"h_res_row_dev": rows, "h_res_col_dev": cols, "num_sublayers": len(streams)}


def train_one(args: argparse.Namespace, residual_dtype: str) -> dict[str, Any]:
    preset = get_preset(args.preset)
    model_cfg = dataclasses.replace(preset.model, residual_dtype=residual_dtype)
    train_cfg = dataclasses.replace(preset.train, num_steps=args.steps)
    task, tokenizer, device = (
        get_task(preset.task, **preset.task_options),
        CharTokenizer(),
        args.dev,
    )
    torch.manual_seed(train_cfg.seed)
    model = build_model(model_cfg, train_cfg, device=device)
    optimizer = build_optimizer(model, train_cfg)
    probe = batch_for_step(task, tokenizer, batch_size=32, seed=12345, step=0).to(device)
    held_out = sample_problems(task, held_out_rng(train_cfg.seed), 256)
    curve: list[dict[str, Any]] = []
    steps = supervised_steps(model, optimizer, task, tokenizer, train_cfg, steps=range(args.steps))
    start = time.perf_counter()
    for row in steps:
        step = row["step"]
        point = {k: row[k] for k in ("step", "main_loss", "mtp_loss", "train_s") if k in row}
        if step % args.probe_every == 0 or step == args.steps - 1:
            point.update(h_res_deviation(model, probe, train_cfg))
        curve.append(point)
    wall = time.perf_counter() - start
    return {
        "residual_dtype": residual_dtype,
        "curve": curve,
        "wall_s": wall,
        "step_ms_median": 1e3 * sorted(p["train_s"] for p in curve)[len(curve) // 2],
        "final_main_loss": sum(tail := [p["main_loss"] for p in curve[-max(1, args.steps // 20) :]])
        / len(tail),
        "held_out_exact_match": teacher_forced_accuracy(model, held_out, tokenizer),
        "max_h_res_row_dev": max(p.get("h_res_row_dev", 0.0) for p in curve),
        "max_h_res_col_dev": max(p.get("h_res_col_dev", 0.0) for p in curve),
    }


def plot(runs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_dev) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        label = {"fp32": "fp32 streams", "autocast": "bf16 streams"}[run["residual_dtype"]]
        steps = [p["step"] for p in run["curve"]]
        ax_loss.plot(steps, [p["main_loss"] for p in run["curve"]], label=label, lw=0.8)
        probes = [p for p in run["curve"] if "h_res_row_dev" in p]
        ax_dev.plot([p["step"] for p in probes], [p["h_res_row_dev"] for p in probes], label=label)
    ax_loss.set(xlabel="step", ylabel="main loss", yscale="log", title="training loss")
    ax_dev.set(xlabel="step", ylabel="max |row sum - 1|", yscale="log", title="H_res row sums")
    for ax in (ax_loss, ax_dev):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="h200-small")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--probe-every", type=int, default=100)
    parser.add_argument("--dtypes", default="fp32,autocast")
    parser.add_argument("--plot", default=None, help="write the two curves to this PNG")
    parser.add_argument("--quick", action="store_true", help="tiny-cpu, 6 steps (a smoke test)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.probe_every = "tiny-cpu", 6, 3
    args.dev = torch.device(args.device)
    runs = [train_one(args, dtype) for dtype in args.dtypes.split(",")]
    keys = ("final_main_loss", "held_out_exact_match", "step_ms_median", "max_h_res_row_dev")
    for run in runs:
        print(run["residual_dtype"], "  ".join(f"{k}={run[k]:.4g}" for k in keys), flush=True)
    name = f"stream_dtype-{args.dev.type}{'-quick' if args.quick else ''}.json"
    out = args.out or REPO_ROOT / "benchmarks" / "results" / name
    args.dev = str(args.dev)
    result = {"args": json_args(args), "preset": args.preset, "steps": args.steps, "runs": runs}
    write_result(out, result, device=args.dev, indent=1)
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
