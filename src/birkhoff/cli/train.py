"""`birkhoff train`: supervised training of a preset's model on its task (birkhoff.train.loop)."""

from __future__ import annotations

import argparse
from pathlib import Path

from birkhoff.cli.common import (
    RunFailed,
    UsageError,
    add_job_arguments,
    check_trackers,
    is_main,
    open_trackers,
    prepare_on_main,
    resolve_device,
    set_threads,
    start_job,
)
from birkhoff.cli.config import add_config_arguments, preset_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny-cpu", help="the run's settings")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--steps", type=int, default=None, help="train.num_steps")
    parser.add_argument("--seed", type=int, default=None, help="train.seed")
    add_config_arguments(parser)
    add_job_arguments(parser)


FLAGS = {"steps": "train.num_steps", "seed": "train.seed"}  # dedicated flag -> setting


def run(args: argparse.Namespace) -> int:
    try:
        preset = preset_from_args(args, args.preset, FLAGS)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads={args.threads} is invalid: must be >= 1")
    except ValueError as err:
        raise UsageError(str(err)) from err
    train = preset.train
    if resolve_device(args.device) != "cuda" and train.amp_dtype == "bf16":
        raise UsageError(
            f"preset {preset.name!r} trains with bf16 autocast, which needs CUDA; "
            f"--device is {resolve_device(args.device)}"
        )
    check_trackers(args)
    device = start_job(args, preset, num_items=train.batch_size, what="batch_size")
    prepare_on_main(args.out, overwrite=args.overwrite, outputs=("metrics.jsonl", "checkpoint"))

    import torch

    from birkhoff.overrides import as_settings
    from birkhoff.tasks.problems import get_task
    from birkhoff.train.loop import run_training, summary_lines
    from birkhoff.train.step import NonFiniteError

    set_threads(device, args.threads or preset.num_threads)
    task = get_task(preset.task, **preset.task_options)
    extra = {
        "preset": preset.name,
        "task": preset.task,
        "task_options": preset.task_options,
        "config": as_settings(preset),
    }
    try:
        summary = run_training(
            preset.model,
            train,
            task,
            args.out,
            device=torch.device(device),
            progress=not args.no_progress,
            name=preset.name,
            extra=extra,
            trackers=open_trackers(args, args.out, preset, resume_step=None),
        )
    except NonFiniteError as err:
        raise RunFailed(f"training stopped: {err}") from err
    if is_main():
        for line in summary_lines(summary):
            print(line)
    return 0
