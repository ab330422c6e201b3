"""What every subcommand shares: the one-line user error, the device, the output directory,
the flags of the jobs that train and their torchrun set-up.

A user error is a `UsageError`: birkhoff.cli.commands prints it as one line and exits with code 2
before anything is written.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention


class UsageError(Exception):
    """A user error the CLI reports as one line with exit code 2."""


class RunFailed(Exception):
    """A run that could not go on (e.g. non-finite losses); one line, exit code 1."""


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


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by the jobs that train (`train`, `run`)."""
    parser.add_argument(
        "--log",
        action="append",
        default=[],
        choices=("tensorboard", "wandb"),
        help="also log to TensorBoard (OUT/tensorboard) or W&B; repeatable; "
        "metrics.jsonl is always written",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: cuda when available",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: the preset's num_threads)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a previous run")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "nccl", "gloo"),
        help="torchrun only: nccl on cuda, gloo on cpu by default",
    )


def start_job(args: argparse.Namespace, config: Any, *, num_items: int, what: str) -> str:
    """The device of this process; under torchrun, join the process group first.

    Every check either runs alike on every rank (before the group exists) or is agreed on by
    all ranks (the config and flags, compared by hash), so a bad launch never hangs.
    """
    from birkhoff.runtime import distributed

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
        distributed.check_same_config(repr(config) + repr(flags))
    except ValueError as err:
        raise UsageError(str(err)) from err
    return str(ctx.device)


def prepare_on_main(
    out: Path, *, overwrite: bool, outputs: tuple[str, ...], hint: str = OVERWRITE_HINT
) -> None:
    """`prepare_out_dir` on rank 0; its verdict stops every rank alike (one process: itself)."""
    from birkhoff.runtime import distributed

    error = None
    if distributed.current().is_main:
        try:
            prepare_out_dir(out, overwrite=overwrite, outputs=outputs, hint=hint)
        except UsageError as err:
            error = str(err)
    try:
        distributed.agree(error)
    except ValueError as err:
        raise UsageError(str(err)) from err


def is_main() -> bool:
    from birkhoff.runtime.distributed import current

    return current().is_main


def open_trackers(
    args: argparse.Namespace, out: Path, config: Any, *, resume_step: int | None
) -> list[Any]:
    """The trackers of `--log` on rank 0 (none elsewhere): runtime.tracking."""
    from birkhoff.overrides import as_settings
    from birkhoff.runtime.tracking import open_trackers as open_all

    if not args.log or not is_main():
        return []
    try:
        return open_all(
            args.log, out, name=str(out), config=as_settings(config), resume_step=resume_step
        )
    except ValueError as err:
        raise UsageError(str(err)) from err


def check_trackers(args: argparse.Namespace) -> None:
    """A missing tracker package is a usage error before anything runs."""
    from birkhoff.runtime.tracking import import_optional

    for name in args.log:
        try:
            import_optional(name, name)
        except ValueError as err:
            raise UsageError(str(err)) from err


def set_threads(device: str, threads: int | None) -> None:
    """torch's intra-op threads on CPU (`--threads`, else the preset's count, else torch's)."""
    import torch

    if device == "cpu" and threads:
        torch.set_num_threads(threads)


class HelpFormatter(argparse.HelpFormatter):
    """Help with each flag's default (when it has one) and the preset names, read when help is
    printed (so building the parser imports no config)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.dest == "preset" and action.option_strings:
            from birkhoff.presets import PRESETS

            text += f" ({' | '.join(PRESETS)}; `birkhoff presets` describes them)"
        default = action.default
        setting = re.match(r"(model|train|rl)\.\w+", text)
        if default is None and setting:  # a dedicated flag for a setting
            text += f" (default: the preset's; tiny-cpu: {default_setting(setting[0])})"
        elif action.option_strings and not (
            default is None or default is False or default == [] or default is argparse.SUPPRESS
        ):  # identity: a default of 0 is shown (0 == False)
            text += " (default: %(default)s)"
        return text


def default_setting(path: str) -> object:
    """The value of setting `path` in the default preset (tiny-cpu)."""
    from birkhoff.presets import tiny_cpu

    value: object = tiny_cpu()
    for part in path.split("."):
        value = getattr(value, part)
    return value


def check_kernels(preset: Any, device: str) -> None:
    """Refuse `train.kernels` a model cannot run on (UsageError naming the flag), and print one
    line where "auto" resolves to other ops than on a Llama-shaped model (V4 on CUDA)."""
    from birkhoff.config import kernels_note, resolve_kernels

    try:
        resolve_kernels(preset.model, preset.train.kernels)
    except ValueError as err:
        raise UsageError(f"--set train.{err}") from err
    note = kernels_note(preset.model, preset.train.kernels, device)
    if note is not None and is_main():
        print(note, flush=True)
