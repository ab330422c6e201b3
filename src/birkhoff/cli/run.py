"""`birkhoff run`: the main job, a supervised warm-up then GRPO with the engine in the loop.

A preset's task or a JSONL file, from a fresh model or a checkpoint: the flags become the
preset (`preset_from_args`) and GRPORun's inputs (birkhoff.rl.inputs reads and checks the
files). Errors are ValueErrors naming the flag; the command prints them as one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from birkhoff.cli.common import (
    RunFailed,
    UsageError,
    add_job_arguments,
    check_kernels,
    check_trackers,
    is_main,
    open_trackers,
    set_threads,
    start_job,
)
from birkhoff.cli.config import add_config_arguments, preset_from_args, settings_overrides
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
    from birkhoff.rl.loop import GRPORun
    from birkhoff.runtime.stop import StopFlag

RUN_OUTPUTS = ("metrics.jsonl", "checkpoint", "plots.png", "reference", "tensorboard", "wandb")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny-cpu", help="the run's settings")
    parser.add_argument("--out", type=Path, default=None, help="output dir (runs/<preset>)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="rl.warmup_steps")
    parser.add_argument("--steps", type=int, default=None, help="rl.num_steps (GRPO steps)")
    parser.add_argument("--seed", type=int, default=None, help="train.seed")
    parser.add_argument(
        "--checkpoint-every", type=int, default=None, help="rl.checkpoint_every (0: at the end)"
    )
    add_input_arguments(parser)
    add_config_arguments(parser)
    add_resume_arguments(parser)
    add_job_arguments(parser)


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """What the run reads: a start checkpoint, a JSONL or generated task (rl.inputs)."""
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="rl.max_new_tokens (with --data: room for the longest answer)",
    )
    parser.add_argument("--init", type=Path, default=None, help="start from this checkpoint")
    parser.add_argument("--data", type=Path, default=None, help="JSONL task: prompt + answer")
    parser.add_argument("--verifier", default=None, help="exact | numeric[:TOL] | module:fn")
    parser.add_argument("--eval-data", type=Path, default=None, help="held-out JSONL file")
    parser.add_argument(
        "--task",
        default=None,
        help="a generated task instead of the preset's: addition | sorting | "
        "countdown | arithmetic-words",
    )


def inputs_from_args(args: argparse.Namespace) -> tuple[Preset, dict[str, Any]]:
    """The preset of `birkhoff run`'s flags and GRPORun's keyword arguments (run_inputs)."""
    from birkhoff.rl.inputs import run_inputs

    preset = run_preset(args)
    return run_inputs(
        preset,
        task_options=task_options_set(args, preset),
        out=args.out or Path("runs") / preset.name,
        init=args.init,
        data=args.data,
        verifier=args.verifier,
        eval_data=args.eval_data,
        max_new_tokens=args.max_new_tokens,
        task=args.task,
    )


FLAGS = {  # dedicated flag -> setting
    "warmup_steps": "rl.warmup_steps",
    "steps": "rl.num_steps",
    "max_new_tokens": "rl.max_new_tokens",
    "seed": "train.seed",
    "checkpoint_every": "rl.checkpoint_every",
}


def task_options_set(args: argparse.Namespace, preset: Preset) -> dict[str, Any]:
    """The task options the command line or --config set (parsed, as the preset holds them):
    with --task they go to that task rather than being dropped with the preset's own task."""
    prefix = "task_options."
    keys = {o.path.removeprefix(prefix) for o in settings_overrides(args, FLAGS)}
    return {k: preset.task_options[k] for k in keys if k in preset.task_options}


def run_preset(args: argparse.Namespace) -> Preset:
    """The preset with the command line's settings; ValueError for bad values."""
    own_task = args.task is None and args.data is None and args.init is None
    preset = preset_from_args(args, args.preset, FLAGS, own_task=own_task)
    if preset.rl is None:
        raise ValueError(f"preset={args.preset!r} has no RL config")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads={args.threads} is invalid: must be >= 1")
    check_resume_flags(args)
    return preset


def run(args: argparse.Namespace) -> int:
    from birkhoff.runtime.stop import StopFlag, stop_on_signals

    try:
        preset, inputs = inputs_from_args(args)
    except ValueError as err:
        raise UsageError(str(err)) from err
    out = args.out or Path("runs") / preset.name
    assert preset.rl is not None
    check_trackers(args)
    device = start_job(args, preset, num_items=preset.rl.num_prompts, what="num_prompts")
    check_kernels(preset, device)
    prepare_run_dir(out, preset, resume=args.resume, overwrite=args.overwrite, outputs=RUN_OUTPUTS)
    with stop_on_signals(StopFlag()) as flag:  # from here on a signal stops at a step boundary
        return run_grpo(args, preset, inputs, out=out, device=device, flag=flag)


def run_grpo(
    args: argparse.Namespace,
    preset: Preset,
    inputs: dict[str, Any],
    *,
    out: Path,
    device: str,
    flag: StopFlag,
) -> int:
    """`birkhoff run` once its flags are checked: build (or resume), run, report."""
    from birkhoff.rl.loop import GRPORun
    from birkhoff.runtime.checkpoint import CheckpointError
    from birkhoff.runtime.plots import plot_run
    from birkhoff.runtime.stop import exit_code
    from birkhoff.tasks.guard import VerifierFailureError
    from birkhoff.train.step import NonFiniteError

    set_threads(device, args.threads or preset.num_threads)
    grpo = GRPORun(preset, out, device=device, **inputs)
    if args.resume:
        try:
            grpo.resume()
        except (CheckpointError, ValueError) as err:
            raise UsageError(f"--resume: {err}") from err
        check_stop_after(args.stop_after, grpo.step)
        if is_main():
            print(resume_line(grpo, out))
        if grpo.step == grpo.total_steps:
            return 0
    grpo.log.trackers = open_trackers(
        args, out, preset, resume_step=grpo.step if args.resume else None
    )
    try:
        grpo.run(stop_after=args.stop_after, progress=not args.no_progress, stop=flag)
    except VerifierFailureError as err:  # user code, not birkhoff: one line, no traceback
        raise UsageError(f"run stopped at step {grpo.step}: {err}") from err
    except NonFiniteError as err:
        raise RunFailed(f"run stopped: {err}") from err
    finally:
        grpo.log.close()
    if is_main():
        plot_run(out / "metrics.jsonl", out / "plots.png")
        if grpo.stopped_by is not None:
            line = stopped_line(
                out,
                reason=grpo.stopped_by,
                step=grpo.step,
                total=grpo.total_steps,
                argv=args.argv,
                world_size=grpo.dist.world_size,
            )
            print(line, flush=True)
        else:
            for line in run_summary(grpo.log.rows(), out):
                print(line)
    return exit_code(grpo.stopped_by)


def resume_line(grpo: GRPORun, out: Path) -> str:
    """Where a resumed run continues from (or that it is finished)."""
    warmup, total = grpo.rl.warmup_steps, grpo.total_steps
    if grpo.step == total:
        return finished_line(out, total)
    phase = (
        f"warm-up step {grpo.step + 1} of {warmup}"
        if grpo.step < warmup
        else f"GRPO step {grpo.step - warmup + 1} of {grpo.rl.num_steps}"
    )
    return f"resuming {out} at step {grpo.step + 1} of {total} ({phase})"


def run_summary(rows: list[dict[str, Any]], out: Path) -> list[str]:
    evals = [r for r in rows if r["phase"] == "eval"]
    grpo = [r for r in rows if r["phase"] == "grpo"]
    lines = [f"outputs: {out}/metrics.jsonl, {out}/plots.png, {out}/checkpoint"]
    if evals:
        first, last = evals[0], evals[-1]
        for key in ("eval_reward", "eval_sampled_reward"):
            if key in first:
                lines.append(
                    f"{key}: {first[key]:.3f} (step {first['step']}) -> "
                    f"{last[key]:.3f} (step {last['step']})"
                )
    if grpo:

        def mean(key: str) -> float:
            return sum(r.get(key, 0.0) for r in grpo) / len(grpo)

        lines.append(
            f"GRPO steps {len(grpo)}: MTP acceptance (draft 1) {mean('accept_1'):.3f}, "
            f"generate {mean('generate_s'):.3f}s, train {mean('train_s'):.3f}s, "
            f"refit {mean('refit_s') * 1e3:.1f}ms per step"
        )
    return lines
