"""`birkhoff import-hf` and `birkhoff export-hf`: their arguments and what each runs.

The module imports nothing heavy at the top (argparse and pathlib only), so building the
`birkhoff` parser stays fast; torch and the converters load when a command runs. User errors
raise ValueError (an existing --out without --overwrite, a bad checkpoint); `run` prints them
as one line with exit code 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from birkhoff.cli.common import UsageError


def add_hf_arguments(parser: argparse.ArgumentParser, source: str) -> None:
    parser.add_argument("source", type=Path, help=source)
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def add_import_hf_arguments(parser: argparse.ArgumentParser) -> None:
    add_hf_arguments(parser, "HuggingFace checkpoint directory, or a .gguf file")
    parser.add_argument(
        "--streams", type=int, default=None, help="S mHC streams (upcycled; default 1, V4: its own)"
    )
    parser.add_argument(
        "--mtp-depth", type=int, default=None, help="M MTP depths (upcycled; V4: keep the first M)"
    )
    parser.add_argument("--max-seq-len", type=int, default=None, help="default: the model's")


def add_export_hf_arguments(parser: argparse.ArgumentParser) -> None:
    add_hf_arguments(parser, "birkhoff checkpoint directory (S = 1, or a DeepSeek-V4 model)")
    parser.add_argument("--drop-mtp", action="store_true", help="leave MTP weights out")
    parser.add_argument(
        "--layout",
        choices=("transformers", "deepseek"),
        default="transformers",
        help="DeepSeek-V4 tensor names: transformers' or DeepSeek's original ones",
    )
    parser.add_argument("--fp8", action="store_true", help="DeepSeek-V4: block-fp8 matmul weights")


def check_out(args: argparse.Namespace) -> None:
    if args.out.exists() and not args.overwrite:
        raise ValueError(f"--out {args.out}: already exists; pass --overwrite to replace it")


def run_import_hf(args: argparse.Namespace) -> Path:
    """Import `args.source` (an HF directory or a GGUF file) into a birkhoff checkpoint at
    `args.out`; returns its path."""
    from birkhoff.interop.gguf import import_gguf
    from birkhoff.interop.hf import import_hf

    check_out(args)
    if args.source.suffix == ".gguf":
        streams = 1 if args.streams is None else args.streams
        depth = 0 if args.mtp_depth is None else args.mtp_depth
        return import_gguf(
            args.source,
            args.out,
            num_streams=streams,
            mtp_depth=depth,
            max_seq_len=args.max_seq_len,
        )
    return import_hf(
        args.source,
        args.out,
        num_streams=args.streams,
        mtp_depth=args.mtp_depth,
        max_seq_len=args.max_seq_len,
    )


def run_export_hf(args: argparse.Namespace) -> Path:
    """Export the checkpoint `args.source` as a HuggingFace directory at `args.out`."""
    from birkhoff.interop.hf import export_hf

    check_out(args)
    return export_hf(
        args.source, args.out, drop_mtp=args.drop_mtp, layout=args.layout, fp8=args.fp8
    )


RUNS: dict[str, Callable[[argparse.Namespace], Path]] = {
    "import-hf": run_import_hf,
    "export-hf": run_export_hf,
}


def run(args: argparse.Namespace) -> int:
    """`import-hf` / `export-hf`; errors exit with code 2."""
    try:
        print(RUNS[args.command](args))
    except (ValueError, OSError) as err:
        raise UsageError(str(err)) from err
    return 0
