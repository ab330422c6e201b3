"""HuggingFace interop entry points: `import_hf`, `export_hf`, and a command line for both.

python -m birkhoff.interop.hf import DIR --out CKPT [--streams S] [--mtp-depth M]
python -m birkhoff.interop.hf export CKPT --out DIR [--drop-mtp]
"""

from __future__ import annotations

import argparse

from birkhoff.interop.hf_export import export_hf
from birkhoff.interop.hf_import import import_hf

__all__ = ["export_hf", "import_hf", "main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m birkhoff.interop.hf")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF checkpoint directory -> birkhoff checkpoint")
    imp.add_argument("directory")
    imp.add_argument("--out", required=True)
    imp.add_argument("--streams", type=int, default=1, help="S mHC streams (upcycled)")
    imp.add_argument("--mtp-depth", type=int, default=0, help="M MTP depths (upcycled)")
    imp.add_argument("--max-seq-len", type=int, default=None)
    exp = sub.add_parser("export", help="S=1 birkhoff checkpoint -> HF checkpoint directory")
    exp.add_argument("checkpoint")
    exp.add_argument("--out", required=True)
    exp.add_argument("--drop-mtp", action="store_true", help="leave MTP weights out")
    args = parser.parse_args(argv)
    if args.command == "import":
        path = import_hf(args.directory, args.out, num_streams=args.streams,
                         mtp_depth=args.mtp_depth, max_seq_len=args.max_seq_len)  # fmt: skip
    else:
        path = export_hf(args.checkpoint, args.out, drop_mtp=args.drop_mtp)
    print(path)


if __name__ == "__main__":
    main()
