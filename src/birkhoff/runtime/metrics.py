"""The one metrics log of every job: metrics.jsonl, memory figures, the run's PNG plots.

Each line of metrics.jsonl is one JSON object with `step` and `phase` ("sft" | "grpo" | "eval"),
written by `birkhoff train` and `birkhoff run` alike, flushed and fsynced as written, so a crashed
run keeps its history. Timing (`*_s`, `*_gb_s`) and memory (`mem_*`) keys vary between runs;
every other value is deterministic on CPU for a fixed seed, which the resume test relies on.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any

import torch

from birkhoff.runtime.checkpoint import atomic_write_bytes


def reset_peak_memory(device: torch.device) -> None:
    """Start a step's peak memory figure afresh (CUDA; the CPU figure is the process's peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak GPU bytes since `reset_peak_memory` (CUDA) or the process's peak RSS (CPU), in MiB.

    CUDA also reports the bytes the caching allocator holds (`mem_reserved_mib`): a step replayed
    from a CUDA graph (TrainConfig.cuda_graph) allocates nothing while it runs, its activations
    live in the graph's pool, which counts there and not in the peak."""
    if device.type == "cuda":
        return {"mem_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20,
                "mem_reserved_mib": torch.cuda.memory_reserved(device) / 2**20}  # fmt: skip
    return {"mem_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class MetricsLog:
    """Append-only JSON lines, flushed per line; `truncate_after` rewrites atomically.

    `last` holds the floats of the latest row plus those of the latest eval, for the progress
    display.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last: dict[str, Any] = {}

    def append(self, row: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        floats = {k: v for k, v in row.items() if isinstance(v, float)}
        if row.get("phase") != "eval":  # keep the latest eval, drop the other phase's keys
            self.last = {k: v for k, v in self.last.items() if k.startswith("eval_")}
        self.last.update(floats)

    def rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Keep the rows of the first `step` steps, which a checkpoint at `step` holds (a resumed
        run rewrites what follows): train rows count from 0 (the row of step k is the (k+1)-th
        step), eval rows count steps completed."""
        kept = [r for r in self.rows() if r["step"] < step + (r.get("phase") == "eval")]
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept)
        atomic_write_bytes(self.path, text.encode())

    def postfix(self) -> dict[str, str]:
        """The figures the progress display shows, three decimals each."""
        keys = ("main_loss", "mtp_loss", "seq_acc", "reward", "eval_reward", "accept_1")
        return {k: f"{self.last[k]:.3f}" for k in keys if k in self.last}


PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward", "eval_sampled_reward", "eval_reward")),
    ("loss", ("main_loss", "policy_loss", "mtp_loss")),
    ("MTP acceptance", ("accept_1", "accept_2", "accept_3", "eval_accept_1")),
    (
        "peak memory, MiB (CUDA: allocated, reserved; CPU: process RSS)",
        ("mem_peak_mib", "mem_reserved_mib"),
    ),
    ("seconds per step", ("generate_s", "train_s", "refit_s")),
)


# only for runs that logged it (MoE models)
MOE_PANEL = ("MoE expert load", ("moe_max_over_mean", "moe_rerouted_fraction"))


def plot_run(metrics_path: Path, out_png: Path) -> Path:
    """One PNG with a panel per concern: reward, losses, acceptance, memory, time per stage,
    and the expert load of MoE runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = MetricsLog(metrics_path).rows()
    panels = PANELS + ((MOE_PANEL,) if any("moe_max_over_mean" in r for r in rows) else ())
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True)
    for ax, (title, keys) in zip(axes, panels, strict=True):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=key, marker="." if len(pts) < 40 else "")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[-1].set_xlabel("step (warm-up, then GRPO)")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out_png)
    return out_png
