"""The `birkhoff` command line: one subcommand per job, each a small (add_arguments, run) pair.

Subcommands: `run`, `train`, `generate`, `consolidate`, `import-hf`, `export-hf`.
- `run`: the main job, a supervised warm-up then GRPO with the engine in the loop (a preset's
  task or a JSONL file, from a fresh model or a checkpoint: birkhoff.rl.inputs);
- `train`: supervised training only;
- `generate`: complete prompts with a checkpoint (its tokenizer.json when it has one);
- `consolidate`: turn a sharded (torchrun) checkpoint into the single-directory format;
- `import-hf` / `export-hf`: HuggingFace Llama-family checkpoints in and out (docs/interop.md).
Benchmarks are scripts in benchmarks/, not subcommands.

`run` and `train` also run data-parallel: `torchrun --nproc-per-node N -m birkhoff run ...`
starts one process per device (birkhoff.train.distributed). A bad launch (a CPU run asking for
NCCL, more processes than prompts or rows per step, ranks given different presets or flags, an
output directory one rank cannot use) stops every rank with the same one-line error.

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

from birkhoff.interop.commands import add_export_hf_arguments, add_import_hf_arguments
from birkhoff.rl.inputs import add_input_arguments, inputs_from_args

if TYPE_CHECKING:  # imported lazily at run time: `birkhoff --help` stays fast
    from birkhoff.presets import Preset

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention


class UsageError(Exception):
    """A user error the CLI reports as one line with exit code 2."""


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine")
    return name


OVERWRITE_HINT = "pass --overwrite to replace"


def prepare_out_dir(
    out: Path, *, overwrite: bool, outputs: tuple[str, ...], hint: str = OVERWRITE_HINT
) -> None:
    """Create `out` (if needed) and check it is writable and holds no previous run's outputs."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    clashes = [name for name in outputs if (out / name).exists()]
    if clashes and not overwrite:
        raise UsageError(f"--out {out}: already holds {clashes}; {hint}")
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
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"),
                        help="torchrun only: nccl on cuda, gloo on cpu by default")  # fmt: skip


def start_job(args: argparse.Namespace, preset: Preset, *, num_items: int, what: str) -> str:
    """The device of this process; under torchrun, join the process group first.

    Every check either runs alike on every rank (before the group exists) or is agreed on by
    all ranks (the preset and flags, compared by hash), so a bad launch never hangs.
    """
    from birkhoff.train import distributed

    device = resolve_device(args.device)
    if not distributed.launched_by_torchrun():
        if args.backend != "auto":
            raise UsageError(f"--backend {args.backend}: only for runs launched by torchrun")
        return device
    try:
        distributed.resolve_backend(device, args.backend)
        distributed.check_world_size(int(os.environ["WORLD_SIZE"]), num_items, what)
        ctx = distributed.init_distributed(device, args.backend)
        flags = {k: str(v) for k, v in sorted(vars(args).items()) if not callable(v)}
        distributed.check_same_config(repr(preset) + repr(flags))
    except ValueError as err:
        raise UsageError(str(err)) from err
    return str(ctx.device)


def prepare_on_main(out: Path, *, overwrite: bool, outputs: tuple[str, ...], **hint: str) -> None:
    """`prepare_out_dir` on rank 0; its verdict stops every rank alike (one process: itself)."""
    from birkhoff.train import distributed

    error = None
    if distributed.current().is_main:
        try:
            prepare_out_dir(out, overwrite=overwrite, outputs=outputs, **hint)
        except UsageError as err:
            error = str(err)
    try:
        distributed.agree(error)
    except ValueError as err:
        raise UsageError(str(err)) from err


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny-cpu", help="a name in birkhoff.presets.PRESETS")
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
    if resolve_device(args.device) != "cuda" and train.amp_dtype == "bf16":
        raise UsageError(f"preset {preset.name!r} trains with bf16 autocast, which needs CUDA; "
                         f"--device is {resolve_device(args.device)}")  # fmt: skip
    device = start_job(args, preset, num_items=train.batch_size, what="batch_size")
    prepare_on_main(args.out, overwrite=args.overwrite, outputs=("metrics.jsonl", "checkpoint"))

    import torch

    from birkhoff.train.loop import run_training, summary_lines

    threads = args.threads or preset.num_threads
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    summary = run_training(preset, args.out, device=torch.device(device),
                           progress=not args.no_progress)  # fmt: skip
    if is_main():
        for line in summary_lines(summary):
            print(line)
    return 0


def is_main() -> bool:
    from birkhoff.train.distributed import current

    return current().is_main


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
    from birkhoff.interop.tokenizer import checkpoint_tokenizer
    from birkhoff.tasks.batches import text_prompt_ids
    from birkhoff.train.checkpoint import load_checkpoint
    from birkhoff.train.dcp import is_sharded_checkpoint

    device = resolve_device(args.device)
    if is_sharded_checkpoint(args.checkpoint):
        raise UsageError(f"--checkpoint {args.checkpoint}: a sharded checkpoint; run `birkhoff "
                         "consolidate --checkpoint DIR --out NEW_DIR` first")  # fmt: skip
    try:
        tok = checkpoint_tokenizer(args.checkpoint)
        params = SamplingParams(args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop_token_ids=tok.stop_ids,
                                num_speculative_tokens=args.speculative)  # fmt: skip
        prompts = [text_prompt_ids(text, tok) for text in args.prompt]
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
    parser.add_argument(
        "--preset", default="tiny-cpu", help="tiny-cpu | tiny-cpu-moe | h200-grpo | h200-grpo-moe"
    )
    parser.add_argument("--out", type=Path, default=None, help="output dir (runs/<preset>)")
    parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    parser.add_argument("--warmup-steps", type=int, default=None, help="supervised steps")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps")
    parser.add_argument("--seed", type=int, default=None, help="override the preset's seed")
    add_input_arguments(parser)  # --init, --data, --verifier, --eval-data, --max-new-tokens
    stop_help = "stop (checkpointed) after this global step; --resume later"
    parser.add_argument("--stop-after", type=int, default=None, help=stop_help)
    add_job_arguments(parser)


def run_run(args: argparse.Namespace) -> int:
    from birkhoff.train.stop import StopFlag, stop_on_signals

    try:
        preset, inputs = inputs_from_args(args)
    except ValueError as err:
        raise UsageError(str(err)) from err
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in --out, --overwrite replaces it: pass one")
    out = args.out or Path("runs") / preset.name
    assert preset.rl is not None
    device = start_job(args, preset, num_items=preset.rl.num_prompts, what="num_prompts")
    if args.resume:
        if not (out / "checkpoint").is_dir():
            raise UsageError(f"--resume: {out / 'checkpoint'} does not exist")
    else:
        resumable = (out / "checkpoint").is_dir()
        hint = "pass --resume to continue it or --overwrite to replace it"
        prepare_on_main(out, overwrite=args.overwrite, outputs=RUN_OUTPUTS,
                        hint=hint if resumable else OVERWRITE_HINT)  # fmt: skip
        if is_main():
            (out / "metrics.jsonl").unlink(missing_ok=True)
    with stop_on_signals(StopFlag()) as flag:  # from here on a signal stops at a step boundary
        return run_grpo(args, preset, inputs, out=out, device=device, flag=flag)


def run_grpo(
    args: argparse.Namespace, preset: Preset, inputs: dict[str, Any], *, out: Path, device: str,
    flag: Any,
) -> int:  # fmt: skip
    """`birkhoff run` once its flags are checked: build (or resume), run, report."""
    import torch

    from birkhoff.rl.loop import GRPORun
    from birkhoff.train.checkpoint import CheckpointError
    from birkhoff.train.metrics import plot_run
    from birkhoff.train.stop import exit_code, resume_command

    threads = args.threads or preset.num_threads
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    run = GRPORun(preset, out, device=device, **inputs)
    if args.resume:
        try:
            run.resume()
        except (CheckpointError, ValueError) as err:
            raise UsageError(f"--resume: {err}") from err
        if args.stop_after is not None and args.stop_after <= run.step:
            raise UsageError(f"--stop-after {args.stop_after}: the checkpoint already holds "
                             f"step {run.step}")  # fmt: skip
        if is_main():
            print(resume_line(run, out))
        if run.step == run.total_steps:
            return 0
    run.run(stop_after=args.stop_after, progress=not args.no_progress, stop=flag)
    if is_main():
        plot_run(out / "metrics.jsonl", out / "plots.png")
        if run.stopped_by is not None:
            command = resume_command(args.argv, reason=run.stopped_by,
                                     world_size=run.dist.world_size)  # fmt: skip
            print(f"stopped ({run.stopped_by}): {out / 'checkpoint'} holds step {run.step} of "
                  f"{run.total_steps}; resume with: {command}", flush=True)  # fmt: skip
        else:
            for line in run_summary(run.log.rows(), out):
                print(line)
    return exit_code(run.stopped_by)


def resume_line(run: Any, out: Path) -> str:
    """Where a resumed run continues from (or that it is finished)."""
    warmup, total = run.rl.warmup_steps, run.total_steps
    if run.step == total:
        return (f"--resume: {out} is finished ({total} of {total} steps); nothing to run "
                "(raise --steps to continue it)")  # fmt: skip
    phase = (f"warm-up step {run.step + 1} of {warmup}" if run.step < warmup
             else f"GRPO step {run.step - warmup + 1} of {run.rl.num_steps}")  # fmt: skip
    return f"resuming {out} at step {run.step + 1} of {total} ({phase})"


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


# ---------------------------------------------------------------------------- consolidate


def add_consolidate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, required=True, help="sharded checkpoint")
    parser.add_argument("--out", type=Path, required=True, help="new checkpoint directory")


def run_consolidate(args: argparse.Namespace) -> int:
    from birkhoff.train.checkpoint import CheckpointError
    from birkhoff.train.dcp import consolidate

    if args.out.exists():
        raise UsageError(f"--out {args.out}: already exists")
    try:
        path = consolidate(args.checkpoint, args.out)
    except CheckpointError as err:
        raise UsageError(str(err)) from err
    print(f"consolidated {args.checkpoint} -> {path}")
    return 0


def run_hf(args: argparse.Namespace) -> int:
    """`import-hf` / `export-hf` (birkhoff.interop.commands); errors exit with code 2."""
    from birkhoff.interop.commands import RUNS

    try:
        print(RUNS[args.command](args))
    except (ValueError, OSError) as err:
        raise UsageError(str(err)) from err
    return 0


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
    "consolidate": (
        "write a sharded checkpoint as one safetensors checkpoint",
        add_consolidate_arguments,
        run_consolidate,
    ),
    "import-hf": ("HuggingFace Llama-family checkpoint -> birkhoff checkpoint",
                  add_import_hf_arguments, run_hf),
    "export-hf": ("S = 1 birkhoff checkpoint -> HuggingFace checkpoint",
                  add_export_hf_arguments, run_hf),
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="birkhoff", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(command)
        command.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv  # `birkhoff run` prints the command that resumes it
    try:
        return int(args.run(args))
    except UsageError as err:
        print(f"birkhoff {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # outside a run's steps (those stop at a step boundary)
        print(f"\nbirkhoff {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        end_process_group()


def end_process_group() -> None:
    """Leave torchrun's process group, if this process joined one."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
