"""`birkhoff consolidate`: a sharded (torchrun) checkpoint as one safetensors checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from birkhoff.cli.common import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, required=True, help="sharded checkpoint")
    parser.add_argument("--out", type=Path, required=True, help="new checkpoint directory")


def run(args: argparse.Namespace) -> int:
    from birkhoff.runtime.checkpoint import CheckpointError
    from birkhoff.runtime.dcp import consolidate

    if args.out.exists():
        raise UsageError(f"--out {args.out}: already exists")
    try:
        path = consolidate(args.checkpoint, args.out)
    except CheckpointError as err:
        raise UsageError(str(err)) from err
    print(f"consolidated {args.checkpoint} -> {path}")
    return 0
