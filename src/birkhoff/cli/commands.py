"""The `birkhoff` parser: one subparser per job, each module's (add_arguments, run) pair.

A subcommand registers `add_arguments(parser)` and `run(args) -> int` in `SUBCOMMANDS`, so a new
job is one more module and one more entry. User errors (`UsageError`) print one clear line to
stderr and exit with code 2 before anything is written; argparse's own errors use code 2 as well.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from birkhoff.cli import consolidate, evaluate, generate, hf, presets, run, train
from birkhoff.cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    HelpFormatter,
    RunFailed,
    UsageError,
)
from birkhoff.cli.config import dotted_overrides

AddArguments = Callable[[argparse.ArgumentParser], None]

SUBCOMMANDS: dict[str, tuple[str, AddArguments, Callable[..., int]]] = {
    "train": ("supervised training of a preset on its task", train.add_arguments, train.run),
    "generate": ("complete prompts with a checkpoint", generate.add_arguments, generate.run),
    "run": (
        "supervised warm-up, then GRPO with the engine in the loop",
        run.add_arguments,
        run.run,
    ),
    "eval": (
        "a checkpoint on a task or a JSONL file: pass@1, pass@k, reward, tokens/s",
        evaluate.add_arguments,
        evaluate.run,
    ),
    "presets": (
        "list the presets, or print one's settings as TOML",
        presets.add_arguments,
        presets.run,
    ),
    "consolidate": (
        "write a sharded checkpoint as one safetensors checkpoint",
        consolidate.add_arguments,
        consolidate.run,
    ),
    "import-hf": (
        "HuggingFace Llama-family checkpoint -> birkhoff checkpoint",
        hf.add_import_hf_arguments,
        hf.run,
    ),
    "export-hf": (
        "S = 1 birkhoff checkpoint -> HuggingFace checkpoint",
        hf.add_export_hf_arguments,
        hf.run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    from birkhoff import __version__, cli

    assert cli.__doc__ is not None
    parser = argparse.ArgumentParser(prog="birkhoff", description=cli.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"birkhoff {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, run_command) in SUBCOMMANDS.items():
        command = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        add_arguments(command)
        command.set_defaults(run=run_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = argv  # `birkhoff run` prints the command that resumes it
    if extra:  # `--rl.lr 1e-4`: only where the command takes settings
        if not hasattr(args, "dotted"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        try:
            args.dotted = dotted_overrides(extra)
        except ValueError as err:
            parser.error(str(err))
    try:
        return int(args.run(args))
    except UsageError as err:
        print(f"birkhoff {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except RunFailed as err:
        print(f"birkhoff {args.command}: {err}", file=sys.stderr)
        return EXIT_FAILED
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
