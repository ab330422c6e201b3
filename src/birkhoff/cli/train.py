"""`birkhoff train`: supervised training of a preset's model on its task (birkhoff.train.loop).

Stops and resumes as `birkhoff run` does (cli/resume.py): a signal ends the run at a step
boundary with a checkpoint and one line naming the command that continues it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from birkhoff.cli.common import (
    RunFailed,
    UsageError,
    add_job_arguments,
    check_kernels,
    check_trackers,
    is_main,
    open_trackers,
    resolve_device,
    set_threads,
    start_job,
)
from birkhoff.cli.config import add_config_arguments, preset_from_args
from birkhoff.cli.resume import (
    add_resume_arguments,
    check_resume_flags,
    check_stop_after,
    finished_line,
    prepare_run_dir,
    stopped_line,
)

if TYPE_CHECKING:  # imported when used: `birkhoff --help` stays fast
    from birkhoff.presets import Preset
    from birkhoff.runtime.stop import StopFlag
    from birkhoff.train.loop import SupervisedRun

TRAIN_OUTPUTS = ("metrics.jsonl", "checkpoint", "tensorboard", "wandb")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny-cpu", help="the run's settings")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--steps", type=int, default=None, help="train.num_steps")
    parser.add_argument("--seed", type=int, default=None, help="train.seed")
    parser.add_argument(
        "--checkpoint-every", type=int, default=None, help="train.checkpoint_every (0: at the end)"
    )
    add_config_arguments(parser)
    add_resume_arguments(parser)
    add_job_arguments(parser)


FLAGS = {  # dedicated flag -> setting
    "steps": "train.num_steps",
    "seed": "train.seed",
    "checkpoint_every": "train.checkpoint_every",
}


def train_preset(args: argparse.Namespace) -> Preset:
    """The preset with the command line's settings; UsageError for bad values."""
    try:
        preset = preset_from_args(args, args.preset, FLAGS, rollouts=False)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads={args.threads} is invalid: must be >= 1")
        check_resume_flags(args)
    except ValueError as err:
        raise UsageError(str(err)) from err
    if resolve_device(args.device) != "cuda" and preset.train.amp_dtype == "bf16":
        raise UsageError(
            f"preset {preset.name!r} trains with bf16 autocast, which needs CUDA; "
            f"--device is {resolve_device(args.device)}"
        )
    return preset


def run(args: argparse.Namespace) -> int:
    from birkhoff.runtime.stop import StopFlag, stop_on_signals

    preset = train_preset(args)
    check_trackers(args)
    device = start_job(args, preset, num_items=preset.train.batch_size, what="batch_size")
    check_kernels(preset, device)
    prepare_run_dir(
        args.out, preset, resume=args.resume, overwrite=args.overwrite, outputs=TRAIN_OUTPUTS
    )
    with stop_on_signals(StopFlag()) as flag:  # from here on a signal stops at a step boundary
        return run_supervised(args, preset, device=device, flag=flag)


def build_run(args: argparse.Namespace, preset: Preset, device: str) -> SupervisedRun:
    """The run of `preset`, resumed from `--out` with `--resume`."""
    import torch

    from birkhoff.overrides import as_settings
    from birkhoff.runtime.checkpoint import CheckpointError
    from birkhoff.tasks.problems import get_task
    from birkhoff.train.loop import SupervisedRun

    set_threads(device, args.threads or preset.num_threads)
    task = get_task(preset.task, **preset.task_options)
    extra = {
        "preset": preset.name,
        "task": preset.task,
        "task_options": preset.task_options,
        "config": as_settings(preset),
    }
    run = SupervisedRun(
        preset.model,
        preset.train,
        task,
        args.out,
        device=torch.device(device),
        name=preset.name,
        extra=extra,
    )
    if args.resume:
        try:
            run.resume()
        except (CheckpointError, ValueError) as err:
            raise UsageError(f"--resume: {err}") from err
        check_stop_after(args.stop_after, run.step)
    return run


def run_supervised(args: argparse.Namespace, preset: Preset, *, device: str, flag: StopFlag) -> int:
    """`birkhoff train` once its flags are checked: build (or resume), train, report."""
    from contextlib import closing

    from birkhoff.runtime.stop import exit_code
    from birkhoff.train.loop import summary_lines
    from birkhoff.train.step import NonFiniteError

    run, total = build_run(args, preset, device), preset.train.num_steps
    if args.resume and is_main():
        print(
            finished_line(args.out, total)
            if run.step >= total
            else f"resuming {args.out} at step {run.step + 1} of {total}"
        )
    if run.step >= total:
        return 0
    resume_step = run.step if args.resume else None
    run.log.trackers = open_trackers(args, args.out, preset, resume_step=resume_step)
    try:
        with closing(run.log):  # the trackers too
            summary = run.run(stop=flag, stop_after=args.stop_after, progress=not args.no_progress)
    except NonFiniteError as err:
        raise RunFailed(f"training stopped: {err}") from err
    if is_main():
        if summary is None:
            assert run.stopped_by is not None
            line = stopped_line(
                args.out,
                reason=run.stopped_by,
                step=run.step,
                total=total,
                argv=args.argv,
                world_size=run.dist.world_size,
            )
            print(line, flush=True)
        else:
            for line in summary_lines(summary):
                print(line)
    return exit_code(run.stopped_by)
