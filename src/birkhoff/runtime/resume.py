"""A run's checkpoint for stop and resume, shared by `birkhoff train` and `birkhoff run`.

`save_run_checkpoint` writes model, optimizer, RNG states, the step and the run's `extra`
(resolved config, counters) atomically: the safetensors format in one process, sharded (DCP)
under torchrun. `load_run_checkpoint` restores all of it into a freshly built run and refuses
the other kind with a message saying what to do. `stop_reason` is the decision, taken between
steps, to stop now: a signal (runtime.stop) or `--stop-after`, the same on every rank. The loops
keep their own bookkeeping (which step is due a checkpoint, which metrics rows to keep:
runtime.metrics `truncate_after`).
Left out: keeping the last-N checkpoints (one per run, replaced atomically).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from birkhoff.model.transformer import Transformer
from birkhoff.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from birkhoff.runtime.dcp import is_sharded_checkpoint, load_sharded, save_sharded
from birkhoff.runtime.distributed import reduce_floats
from birkhoff.runtime.stop import STOP_AFTER, StopFlag


def save_run_checkpoint(
    path: Path,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    extra: dict[str, Any],
    sharded: bool,
) -> Path:
    """Write the run's checkpoint at `step` (every rank calls it when `sharded`)."""
    save = save_sharded if sharded else save_checkpoint
    return save(path, model, optimizer, step=step, extra=extra)


def load_run_checkpoint(
    path: Path, model: Transformer, optimizer: torch.optim.Optimizer, *, sharded: bool
) -> tuple[int, dict[str, Any]]:
    """Restore model, optimizer and RNG states from `path`; (step, extra)."""
    if is_sharded_checkpoint(path) != sharded:
        kind = "sharded (torchrun)" if sharded else "single-process"
        raise CheckpointError(
            f"{path}: this run needs a {kind} checkpoint; resume a sharded "
            "one under torchrun, or consolidate it first"
        )
    if sharded:
        step, extra = load_sharded(path, model, optimizer, restore_rng=True)[1:3]
    else:
        step, extra = load_checkpoint(path, model=model, optimizer=optimizer, restore_rng=True)[2:4]
    return step, extra


def stop_reason(
    stop: StopFlag | None,
    stop_after: int | None,
    *,
    step: int,
    distributed: bool,
    device: torch.device,
) -> str | None:
    """Why a run stops before its step `step` (counted from 0), or None; every rank gives the
    same answer (a signal may reach the ranks before different steps)."""
    reason = stop.reason if stop is not None else None
    if distributed:
        flag = {"stop": float(reason is not None)}
        if reduce_floats(flag, "max", device)["stop"] > 0:
            reason = reason or "a signal to another rank"
    if reason is None and stop_after is not None and step >= stop_after:
        reason = STOP_AFTER
    return reason
