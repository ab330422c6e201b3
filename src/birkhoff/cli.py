"""The `birkhoff` command line: one subcommand per job, each a small (add_arguments, run) pair.

Subcommands: `run`, `train`, `generate`.
- `run`: the main job, a supervised warm-up then GRPO with the engine in the loop;
- `train`: supervised training only;
- `generate`: complete prompts with a checkpoint.
Benchmarks are scripts in benchmarks/, not subcommands.

Design choices: argparse only; a subcommand registers `add_<name>_arguments(parser)` and
`run_<name>(args) -> int` in `SUBCOMMANDS`, so a new job is one more entry. User errors (unknown
preset, unwritable output directory, bad override) print one clear line to stderr and exit with
code 2 before anything is written; argparse's own errors use code 2 as well. Progress goes to
stdout: a bar on a terminal, a plain line every few steps otherwise (birkhoff.train.progress).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily at run time: `birkhoff --help` stays fast
    from birkhoff.presets import Preset

EXIT_USAGE = 2


class UsageError(Exception):
    """A user error the CLI reports as one line with exit code 2."""


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine")
    return name


def prepare_out_dir(out: Path, *, overwrite: bool, outputs: tuple[str, ...]) -> None:
    """Create `out` (if needed) and check it is writable and holds no previous run's outputs."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    clashes = [name for name in outputs if (out / name).exists()]
    if clashes and not overwrite:
        raise UsageError(f"--out {out}: already holds {clashes}; pass --overwrite to replace")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"--out {out}: not writable ({err.strerror or err})") from err


# ---------------------------------------------------------------------------- train


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by the jobs that train (`train`, `run`)."""
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--overwrite", action="store_true", help="replace a previous run")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny-cpu", help="tiny-cpu | h200-small | h200-grpo")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    parser.add_argument("--seed", type=int, default=None, help="override the preset's seed")
    add_job_arguments(parser)


def run_train(args: argparse.Namespace) -> int:
    from birkhoff.presets import get_preset

    try:
        preset = get_preset(args.preset)
        overrides = {"num_steps": args.steps, "seed": args.seed}
        train = preset.train.replace(**{k: v for k, v in overrides.items() if v is not None})
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads={args.threads} is invalid: must be >= 1")
    except ValueError as err:
        raise UsageError(str(err)) from err
    preset = preset.replace(train=train)
    device = resolve_device(args.device)
    if device != "cuda" and train.amp_dtype == "bf16":
        raise UsageError(f"preset {preset.name!r} trains with bf16 autocast, which needs CUDA; "
                         f"--device is {device}")  # fmt: skip
    prepare_out_dir(args.out, overwrite=args.overwrite, outputs=("metrics.jsonl", "checkpoint"))

    import torch

    from birkhoff.train.loop import run_training, summary_lines

    threads = args.threads or preset.num_threads
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    summary = run_training(preset, args.out, device=torch.device(device),
                           progress=not args.no_progress)  # fmt: skip
    for line in summary_lines(summary):
        print(line)
    return 0


# ---------------------------------------------------------------------------- generate


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--speculative", type=int, default=0, help="MTP draft tokens per step")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def run_generate(args: argparse.Namespace) -> int:
    from birkhoff.engine import Engine, SamplingParams
    from birkhoff.tokenizer import CharTokenizer
    from birkhoff.train.checkpoint import load_checkpoint

    device = resolve_device(args.device)
    tok = CharTokenizer()
    try:
        params = SamplingParams(args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop_token_ids=(tok.eos_id,),
                                num_speculative_tokens=args.speculative)  # fmt: skip
        prompts = [[tok.bos_id, *tok.encode(text)] for text in args.prompt]
        model = load_checkpoint(args.checkpoint).model.eval()
        engine = Engine.from_model(model, device=device, max_batch_size=len(prompts),
                                   max_speculative_tokens=max(args.speculative, 1))  # fmt: skip
        completions = engine.generate(prompts, params)
    except ValueError as err:
        raise UsageError(str(err)) from err
    for text, completion in zip(args.prompt, completions, strict=True):
        print(f"{text}{tok.decode(completion.tokens)}")
    stats = engine.last_stats
    if stats is not None:
        rates = ", ".join(f"{r:.2f}" for r in stats.acceptance_rate)
        print(f"acceptance per draft position: {rates}; "
              f"mean accepted length {stats.mean_accepted_length:.2f}")  # fmt: skip
    return 0


# ---------------------------------------------------------------------------- run

RUN_OUTPUTS = ("metrics.jsonl", "checkpoint", "plots.png")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny-cpu", help="tiny-cpu | h200-grpo")
    parser.add_argument("--out", type=Path, default=None, help="output dir (runs/<preset>)")
    parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    parser.add_argument("--warmup-steps", type=int, default=None, help="supervised steps")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps")
    parser.add_argument("--seed", type=int, default=None, help="override the preset's seed")
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop (with a checkpoint) after this global step; --resume later",
    )
    add_job_arguments(parser)


def run_preset(args: argparse.Namespace) -> Preset:
    """The preset with the command line's overrides; ValueError for bad values."""
    from birkhoff.presets import get_preset

    preset = get_preset(args.preset)
    if preset.rl is None:
        raise ValueError(f"preset={args.preset!r} has no RL config")
    rl_overrides = {"warmup_steps": args.warmup_steps, "num_steps": args.steps}
    rl = preset.rl.replace(**{k: v for k, v in rl_overrides.items() if v is not None})
    train = preset.train if args.seed is None else preset.train.replace(seed=args.seed)
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads={args.threads} is invalid: must be >= 1")
    if args.stop_after is not None and args.stop_after < 1:
        raise ValueError(f"--stop-after={args.stop_after} is invalid: must be >= 1")
    return preset.replace(rl=rl, train=train)


def run_run(args: argparse.Namespace) -> int:
    from birkhoff.train.checkpoint import CheckpointError

    try:
        preset = run_preset(args)
    except ValueError as err:
        raise UsageError(str(err)) from err
    out = args.out or Path("runs") / preset.name
    device = resolve_device(args.device)
    if args.resume:
        if not (out / "checkpoint").is_dir():
            raise UsageError(f"--resume: {out / 'checkpoint'} does not exist")
    else:
        prepare_out_dir(out, overwrite=args.overwrite, outputs=RUN_OUTPUTS)
        (out / "metrics.jsonl").unlink(missing_ok=True)

    import torch

    from birkhoff.rl.loop import GRPORun
    from birkhoff.train.metrics import plot_run

    threads = args.threads or preset.num_threads
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    run = GRPORun(preset, out, device=device)
    if args.resume:
        try:
            run.resume()
        except (CheckpointError, ValueError) as err:
            raise UsageError(f"--resume: {err}") from err
    run.run(stop_after=args.stop_after, progress=not args.no_progress)
    plot_run(out / "metrics.jsonl", out / "plots.png")
    for line in run_summary(run.log.rows(), out):
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


# ---------------------------------------------------------------------------- entry point

SUBCOMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[..., int]]
] = {
    "train": ("supervised training of a preset on its task", add_train_arguments, run_train),
    "generate": ("complete prompts with a checkpoint", add_generate_arguments, run_generate),
    "run": (
        "supervised warm-up, then GRPO with the engine in the loop",
        add_run_arguments,
        run_run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="birkhoff", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(command)
        command.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except UsageError as err:
        print(f"birkhoff {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
