"""The `birkhoff` command line: one subcommand per job, each a small (add_arguments, run) pair.

Subcommands: `run`, `train`, `generate`, `import-hf`, `export-hf`.
- `run`: the main job, a supervised warm-up then GRPO with the engine in the loop (on a preset's
  task or a JSONL file, from a fresh model or a checkpoint);
- `train`: supervised training only;
- `generate`: complete prompts with a checkpoint (its tokenizer.json when it has one);
- `import-hf` / `export-hf`: HuggingFace Llama-family checkpoints in and out (docs/interop.md).
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
    from birkhoff.tokenizer import Tokenizer

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
    from birkhoff.interop.tokenizer import checkpoint_tokenizer
    from birkhoff.tasks.batches import text_prompt_ids
    from birkhoff.train.checkpoint import load_checkpoint

    device = resolve_device(args.device)
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
    parser.add_argument("--preset", default="tiny-cpu", help="tiny-cpu | h200-grpo")
    parser.add_argument("--out", type=Path, default=None, help="output dir (runs/<preset>)")
    parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    parser.add_argument("--warmup-steps", type=int, default=None, help="supervised steps")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps")
    parser.add_argument("--seed", type=int, default=None, help="override the preset's seed")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="completion length")
    parser.add_argument("--init", type=Path, default=None, help="start from this checkpoint")
    parser.add_argument("--data", type=Path, default=None, help="JSONL task: prompt + answer")
    parser.add_argument("--verifier", default=None, help="exact | numeric[:TOL] | module:fn")
    parser.add_argument("--eval-data", type=Path, default=None, help="held-out JSONL file")
    stop_help = "stop (checkpointed) after this global step; --resume later"
    parser.add_argument("--stop-after", type=int, default=None, help=stop_help)
    add_job_arguments(parser)


def run_preset(args: argparse.Namespace) -> Preset:
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


def run_inputs(args: argparse.Namespace, preset: Preset) -> tuple[Preset, dict[str, Any]]:
    """The preset and GRPORun's keyword arguments for --init / --data; every file is read and
    checked here, before any training (ValueError naming the flag, file and line)."""
    if args.data is None and (args.verifier is not None or args.eval_data is not None):
        raise ValueError("--verifier and --eval-data need --data FILE.jsonl")
    kwargs: dict[str, Any] = {}
    if args.init is not None:
        preset, kwargs = init_inputs(args.init, preset)
    if args.data is not None:
        preset, data = data_inputs(args, preset, kwargs.get("tokenizer"))
        kwargs.update(data)
    return preset, kwargs


def init_inputs(init: Path, preset: Preset) -> tuple[Preset, dict[str, Any]]:
    """--init CKPT: the checkpoint's model config and tokenizer (weights load in GRPORun)."""
    from birkhoff.interop.tokenizer import checkpoint_tokenizer
    from birkhoff.train.checkpoint import CONFIG_FILE, parse_config, read_manifest, read_verified

    config = read_verified(init, read_manifest(init), CONFIG_FILE)
    cfg = parse_config(init / CONFIG_FILE, config)
    tokenizer = checkpoint_tokenizer(init)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"--init {init}: tokenizer has {tokenizer.vocab_size} ids, "
                         f"the model's vocab_size is {cfg.vocab_size}")  # fmt: skip
    assert preset.rl is not None
    drafts = preset.rl.num_speculative_tokens if cfg.mtp_depth else 0  # no MTP, no drafts
    preset = preset.replace(model=cfg, rl=preset.rl.replace(num_speculative_tokens=drafts))
    return preset, {"init": init, "tokenizer": tokenizer}


def data_inputs(
    args: argparse.Namespace, preset: Preset, tokenizer: Tokenizer | None
) -> tuple[Preset, dict[str, Any]]:
    """--data FILE.jsonl: train and held-out splits, every line checked against the tokenizer."""
    from birkhoff.tasks.jsonl import load_jsonl_tasks
    from birkhoff.tokenizer import CharTokenizer

    tok = tokenizer or CharTokenizer()
    splits = load_jsonl_tasks(args.data, verifier=args.verifier or "exact",
                              eval_path=args.eval_data, seed=preset.train.seed, tokenizer=tok,
                              max_seq_len=preset.model.max_seq_len)  # fmt: skip
    assert preset.rl is not None
    if args.max_new_tokens is None:  # room for the longest answer and its EOS
        longest = max(len(tok.encode(p.answer)) for p in splits.train.problems)
        rl = preset.rl.replace(max_new_tokens=max(preset.rl.max_new_tokens, longest + 1))
        preset = preset.replace(rl=rl)
    return preset, {"task": splits.train, "eval_problems": splits.eval.problems}


def run_run(args: argparse.Namespace) -> int:
    from birkhoff.train.checkpoint import CheckpointError

    try:
        preset, inputs = run_inputs(args, run_preset(args))
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
    run = GRPORun(preset, out, device=device, **inputs)
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


# ---------------------------------------------------------------------------- import/export-hf


def add_hf_arguments(parser: argparse.ArgumentParser, source: str) -> None:
    parser.add_argument("source", type=Path, help=source)
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def add_import_hf_arguments(parser: argparse.ArgumentParser) -> None:
    add_hf_arguments(parser, "HuggingFace checkpoint directory")
    parser.add_argument("--streams", type=int, default=1, help="S mHC streams (upcycled)")
    parser.add_argument("--mtp-depth", type=int, default=0, help="M MTP depths (upcycled)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="default: the model's")


def add_export_hf_arguments(parser: argparse.ArgumentParser) -> None:
    add_hf_arguments(parser, "birkhoff checkpoint directory (S = 1)")
    parser.add_argument("--drop-mtp", action="store_true", help="leave MTP weights out")


def run_hf(args: argparse.Namespace, convert: Callable[[], Path]) -> int:
    """Run an import/export; an existing --out needs --overwrite; errors exit with code 2."""
    if args.out.exists() and not args.overwrite:
        raise UsageError(f"--out {args.out}: already exists; pass --overwrite to replace it")
    try:
        print(convert())
    except (ValueError, OSError) as err:
        raise UsageError(str(err)) from err
    return 0


def run_import_hf(args: argparse.Namespace) -> int:
    from birkhoff.interop.hf import import_hf

    options = {"num_streams": args.streams, "mtp_depth": args.mtp_depth,
               "max_seq_len": args.max_seq_len}  # fmt: skip
    return run_hf(args, lambda: import_hf(args.source, args.out, **options))


def run_export_hf(args: argparse.Namespace) -> int:
    from birkhoff.interop.hf import export_hf

    return run_hf(args, lambda: export_hf(args.source, args.out, drop_mtp=args.drop_mtp))


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
    "import-hf": ("HuggingFace Llama-family checkpoint -> birkhoff checkpoint",
                  add_import_hf_arguments, run_import_hf),
    "export-hf": ("S = 1 birkhoff checkpoint -> HuggingFace checkpoint",
                  add_export_hf_arguments, run_export_hf),
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
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except UsageError as err:
        print(f"birkhoff {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
