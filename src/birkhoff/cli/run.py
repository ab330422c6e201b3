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
    UsageError,
    add_job_arguments,
    is_main,
    prepare_on_main,
    set_threads,
    start_job,
)

if TYPE_CHECKING:  # imported when used: `birkhoff --help` stays fast
    from birkhoff.presets import Preset

RUN_OUTPUTS = ("metrics.jsonl", "checkpoint", "plots.png")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", default="tiny-cpu", help="tiny-cpu | tiny-cpu-moe | h200-grpo | h200-grpo-moe"
    )
    parser.add_argument("--out", type=Path, default=None, help="output dir (runs/<preset>)")
    parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    parser.add_argument("--warmup-steps", type=int, default=None, help="supervised steps")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps")
    parser.add_argument("--seed", type=int, default=None, help="override the preset's seed")
    add_input_arguments(parser)
    stop_help = "stop (checkpointed) after this global step; --resume later"
    parser.add_argument("--stop-after", type=int, default=None, help=stop_help)
    add_job_arguments(parser)


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """What the run reads: a start checkpoint, a JSONL or generated task (birkhoff.rl.inputs)."""
    parser.add_argument("--max-new-tokens", type=int, default=None, help="completion length")
    parser.add_argument("--init", type=Path, default=None, help="start from this checkpoint")
    parser.add_argument("--data", type=Path, default=None, help="JSONL task: prompt + answer")
    parser.add_argument("--verifier", default=None, help="exact | numeric[:TOL] | module:fn")
    parser.add_argument("--eval-data", type=Path, default=None, help="held-out JSONL file")
    parser.add_argument("--task", default=None,
                        help="a generated task instead of the preset's: addition | sorting | "
                        "countdown | arithmetic-words")  # fmt: skip


def inputs_from_args(args: argparse.Namespace) -> tuple[Preset, dict[str, Any]]:
    """The preset of `birkhoff run`'s flags and GRPORun's keyword arguments (run_inputs)."""
    from birkhoff.rl.inputs import run_inputs

    return run_inputs(preset_from_args(args), init=args.init, data=args.data,
                      verifier=args.verifier, eval_data=args.eval_data,
                      max_new_tokens=args.max_new_tokens, task=args.task)  # fmt: skip


def preset_from_args(args: argparse.Namespace) -> Preset:
    """The preset with the command line's overrides; ValueError for bad values."""
    from birkhoff.presets import get_preset

    preset = get_preset(args.preset)
    if preset.rl is None:
        raise ValueError(f"preset={args.preset!r} has no RL config")
    rl_overrides = {"warmup_steps": args.warmup_steps, "num_steps": args.steps,
                    "max_new_tokens": args.max_new_tokens}  # fmt: skip
    rl = preset.rl.replace(**{k: v for k, v in rl_overrides.items() if v is not None})
    train = preset.train if args.seed is None else preset.train.replace(seed=args.seed)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads={args.threads} is invalid: must be >= 1")
    if args.stop_after is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after={args.stop_after} is invalid: must be >= 1")
    return preset.replace(rl=rl, train=train)


def run(args: argparse.Namespace) -> int:
    from birkhoff.runtime.checkpoint import CheckpointError

    try:
        preset, inputs = inputs_from_args(args)
    except ValueError as err:
        raise UsageError(str(err)) from err
    out = args.out or Path("runs") / preset.name
    assert preset.rl is not None
    device = start_job(args, preset, num_items=preset.rl.num_prompts, what="num_prompts")
    if args.resume:
        if not (out / "checkpoint").is_dir():
            raise UsageError(f"--resume: {out / 'checkpoint'} does not exist")
    else:
        prepare_on_main(out, overwrite=args.overwrite, outputs=RUN_OUTPUTS)
        if is_main():
            (out / "metrics.jsonl").unlink(missing_ok=True)

    from birkhoff.rl.loop import GRPORun
    from birkhoff.runtime.metrics import plot_run

    set_threads(device, args.threads or preset.num_threads)
    grpo = GRPORun(preset, out, device=device, **inputs)
    if args.resume:
        try:
            grpo.resume()
        except (CheckpointError, ValueError) as err:
            raise UsageError(f"--resume: {err}") from err
    from birkhoff.tasks.guard import VerifierFailureError

    try:
        grpo.run(stop_after=args.stop_after, progress=not args.no_progress)
    except VerifierFailureError as err:  # user code, not birkhoff: one line, no traceback
        raise UsageError(f"run stopped at step {grpo.step}: {err}") from err
    if is_main():
        plot_run(out / "metrics.jsonl", out / "plots.png")
        for line in run_summary(grpo.log.rows(), out):
            print(line)
    return 0


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
