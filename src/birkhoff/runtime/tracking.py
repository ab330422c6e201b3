"""Experiment trackers: each metrics row mirrored to TensorBoard or Weights & Biases.

metrics.jsonl stays the record (a resume truncates and rewrites it, the plot and the summaries
read it); a tracker receives every row as it is written (`MetricsLog.trackers`), as scalars
named `phase/key` ("grpo/reward", "eval/eval_reward", "sft/main_loss") at the row's step.
- `tensorboard`: torch.utils.tensorboard (the `tensorboard` package, extra `birkhoff[tensorboard]`)
  writes OUT/tensorboard; a resumed run purges the events after the checkpoint's step, so the
  steps it repeats appear once.
- `wandb`: the `wandb` package (extra `birkhoff[wandb]`), imported only when asked for. The run id
  is kept in OUT/wandb-run-id, so a resumed run continues the same W&B run; project from
  WANDB_PROJECT (default "birkhoff"); WANDB_MODE=offline keeps everything under OUT/wandb and
  sends nothing (what the tests do). Rows carry `step` as W&B's x axis.
A missing package is a ValueError naming the extra to install, raised before the run starts.
Left out: MLflow and others; images (plots.png is written next to metrics.jsonl).
"""

from __future__ import annotations

import importlib
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

TRACKERS = ("tensorboard", "wandb")
WANDB_ID_FILE = "wandb-run-id"


class Tracker(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers as `phase/key` scalars (step and phase are the coordinates)."""
    phase = row.get("phase", "run")
    return {
        f"{phase}/{k}": float(v)
        for k, v in row.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"
    }


def import_optional(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ValueError(
            f"--log {extra} needs the {extra!r} package: pip install {extra} "
            f"(in a clone of birkhoff also: pip install -e '.[{extra}]')"
        ) from err


class TensorBoardTracker:
    """Scalars into OUT/tensorboard; `resume_step` purges what a stopped run wrote after it."""

    def __init__(self, out: Path, *, resume_step: int | None = None) -> None:
        import_optional("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=resume_step, flush_secs=10)

    def log(self, row: dict[str, Any]) -> None:
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, global_step=row["step"])

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run per output directory (its id kept there); `config` is the run's settings."""

    def __init__(self, out: Path, *, name: str, config: dict[str, Any], resume: bool) -> None:
        wandb = import_optional("wandb", "wandb")
        id_file = out / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.exists() else None
        run_id = run_id or secrets.token_hex(4)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "birkhoff"),
            name=name,
            id=run_id,
            resume="allow",
            dir=str(out),
            config=config,
        )
        id_file.write_text(run_id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: dict[str, Any]) -> None:
        self.run.log({"step": row["step"], **scalars(row)})

    def close(self) -> None:
        self.run.finish()


def open_trackers(
    names: Sequence[str],
    out: Path,
    *,
    name: str,
    config: dict[str, Any],
    resume_step: int | None = None,
) -> list[Tracker]:
    """The trackers `names` asks for (`--log`), opened on `out`; ValueError for a missing one."""
    unknown = sorted(set(names) - set(TRACKERS))
    if unknown:
        raise ValueError(f"--log {unknown[0]} is unknown; valid: {', '.join(TRACKERS)}")
    trackers: list[Tracker] = []
    if "tensorboard" in names:
        trackers.append(TensorBoardTracker(out, resume_step=resume_step))
    if "wandb" in names:
        trackers.append(WandbTracker(out, name=name, config=config, resume=resume_step is not None))
    return trackers
