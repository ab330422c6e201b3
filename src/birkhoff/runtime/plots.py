"""The run's PNG: one panel per concern, drawn from metrics.jsonl.

Panels: reward, the supervised loss, the GRPO policy loss and the MTP loss (each on its own
axis: their scales differ by orders of magnitude), MTP draft acceptance, peak memory and seconds
per stage (both from 0), and the expert load of MoE runs. Curves are labelled in words
(`PANELS` maps each metric key to its label); a dashed line marks where the supervised warm-up
ends and GRPO begins.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from birkhoff.runtime.metrics import MetricsLog

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class Panel(NamedTuple):
    title: str
    curves: tuple[tuple[str, str], ...]  # (metric key, label)
    from_zero: bool = False  # the y axis starts at 0


PANELS: tuple[Panel, ...] = (
    Panel(
        "reward",
        (
            ("reward", "rollouts (mean over the step's completions)"),
            ("eval_sampled_reward", "held-out, sampled"),
            ("eval_reward", "held-out exact match, greedy"),
        ),
    ),
    Panel("supervised loss (warm-up)", (("main_loss", "next-token cross-entropy"),)),
    Panel("GRPO policy loss", (("policy_loss", "clipped surrogate (+ KL)"),)),
    Panel("MTP loss", (("mtp_loss", "cross-entropy, mean over depths"),)),
    Panel(
        "MTP draft acceptance",
        (
            ("accept_1", "draft 1, rollouts"),
            ("accept_2", "draft 2, rollouts"),
            ("accept_3", "draft 3, rollouts"),
            ("eval_accept_1", "draft 1, held-out greedy"),
        ),
    ),
    Panel(
        "peak memory, MiB",
        (
            ("mem_peak_mib", "allocated (CUDA) / process RSS (CPU)"),
            ("mem_reserved_mib", "reserved by the allocator (CUDA)"),
        ),
        from_zero=True,
    ),
    Panel(
        "seconds per step",
        (("generate_s", "generate"), ("train_s", "train"), ("refit_s", "refit")),
        from_zero=True,
    ),
)

# only for runs that logged it (MoE models)
MOE_PANEL = Panel(
    "MoE expert load",
    (
        ("moe_max_over_mean", "busiest expert / mean load"),
        ("moe_rerouted_fraction", "share of tokens rerouted"),
    ),
)


def grpo_start(rows: list[dict[str, Any]]) -> int | None:
    """The step of the first GRPO row (the warm-up's length), None without GRPO rows."""
    return next((r["step"] for r in rows if r.get("phase") == "grpo"), None)


def plot_run(metrics_path: Path, out_png: Path) -> Path:
    """Write the run's PNG (atomically) from its metrics.jsonl; returns its path."""
    import matplotlib.pyplot as plt

    fig = run_figure(MetricsLog(metrics_path).rows())
    out_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out_png)
    return out_png


def run_figure(rows: list[dict[str, Any]]) -> Figure:
    """The figure of `rows`: a panel each, sharing the step axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = PANELS + ((MOE_PANEL,) if any("moe_max_over_mean" in r for r in rows) else ())
    boundary = grpo_start(rows)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True)
    for ax, panel in zip(axes, panels, strict=True):
        for key, label in panel.curves:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=label, marker="." if len(pts) < 40 else "")
        if boundary is not None and boundary > 0:
            ax.axvline(
                boundary - 0.5,
                color="grey",
                linestyle="--",
                linewidth=1,
                label="warm-up ends, GRPO begins",
            )
        if panel.from_zero:
            ax.set_ylim(bottom=0)
        ax.set_title(panel.title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[-1].set_xlabel("step (supervised warm-up, then GRPO)")
    fig.tight_layout()
    return fig
