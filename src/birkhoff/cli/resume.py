"""The flags and lines of a job that stops and resumes: `--resume`, `--stop-after`, the check of
`--out` before a fresh or a resumed run, the config diff against the checkpoint, and the one line
a stopped run prints. `birkhoff run` and `birkhoff train` share them, so both behave alike
(the mechanism itself: runtime.stop and runtime.resume).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from birkhoff.cli.common import OVERWRITE_HINT, UsageError, is_main, prepare_on_main

if TYPE_CHECKING:
    from birkhoff.presets import Preset

CHECKPOINT = "checkpoint"
IDENTITY = ("name", "task", "task_options", "model")  # what a resumed run may not change
MAX_DIFF_LINES = 8


def add_resume_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    stop_help = "stop (checkpointed) after this many steps; --resume later"
    parser.add_argument("--stop-after", type=int, default=None, help=stop_help)


def check_resume_flags(args: argparse.Namespace) -> None:
    """Contradictory or invalid `--resume` / `--stop-after` / `--overwrite`: ValueError."""
    if args.stop_after is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after={args.stop_after} is invalid: must be >= 1")
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --out, --overwrite replaces it: pass one")


def prepare_run_dir(
    out: Path, preset: Preset, *, resume: bool, overwrite: bool, outputs: tuple[str, ...]
) -> None:
    """Before anything is built: a resumed run's checkpoint exists and holds the same model and
    task (changed settings are printed); a fresh run's `--out` holds none of `outputs` (or
    `--overwrite` removes them, so nothing of the old run is resumed or logged on)."""
    checkpoint = out / CHECKPOINT
    if resume:
        if not checkpoint.is_dir():
            raise UsageError(f"--resume: {checkpoint} does not exist")
        for line in resume_notes(checkpoint, preset):
            print(line)
        return
    hint = "pass --resume to continue it or --overwrite to replace it"
    resumable = checkpoint.is_dir()
    prepare_on_main(
        out, overwrite=overwrite, outputs=outputs, hint=hint if resumable else OVERWRITE_HINT
    )
    if is_main():
        import shutil

        for name in outputs:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)


def check_stop_after(stop_after: int | None, step: int) -> None:
    if stop_after is not None and stop_after <= step:
        raise UsageError(f"--stop-after {stop_after}: the checkpoint already holds step {step}")


def finished_line(out: Path, total: int) -> str:
    return (
        f"--resume: {out} is finished ({total} of {total} steps); nothing to run "
        "(raise --steps to continue it)"
    )


def stopped_line(
    out: Path, *, reason: str, step: int, total: int, argv: Sequence[str], world_size: int
) -> str:
    """The one line a stopped run prints: the step its checkpoint holds, the resume command."""
    from birkhoff.runtime.stop import resume_command

    command = resume_command(argv, reason=reason, world_size=world_size)
    return (
        f"stopped ({reason}): {out / CHECKPOINT} holds step {step} of {total}; "
        f"resume with: {command}"
    )


def resume_notes(path: Path, preset: Preset) -> list[str]:
    """Compare `preset` with the config the checkpoint recorded: a changed model or task is a
    UsageError with a field-by-field diff; changed run-time settings give a note."""
    import json

    from birkhoff.overrides import as_settings, flatten
    from birkhoff.runtime.checkpoint import CheckpointError
    from birkhoff.runtime.dcp import checkpoint_extra

    try:
        recorded = checkpoint_extra(path).get("config")
    except CheckpointError as err:
        raise UsageError(f"--resume: {err}") from err
    if not isinstance(recorded, dict):  # written before checkpoints recorded their config
        return []
    before = flatten(recorded)
    now = flatten(json.loads(json.dumps(as_settings(preset))))
    # settings on one side only are fields added or removed since: not the run's to compare
    changed = [k for k in sorted(before.keys() & now.keys()) if before[k] != now[k]]
    lines = [f"  {k}: {json.dumps(before[k])} -> {json.dumps(now[k])}" for k in changed]
    fixed = [line for k, line in zip(changed, lines, strict=True) if k.startswith(IDENTITY)]
    if fixed:
        more = len(fixed) - MAX_DIFF_LINES
        shown = fixed[:MAX_DIFF_LINES] + ([f"  ... and {more} more"] if more > 0 else [])
        raise UsageError(
            f"{path} holds a run of another model or task (checkpoint -> now):\n"
            + "\n".join(shown)
            + "\nresume with the checkpoint's settings, or start a new --out"
        )
    if lines:
        return ["--resume: settings changed since the checkpoint (checkpoint -> now):", *lines]
    return []
