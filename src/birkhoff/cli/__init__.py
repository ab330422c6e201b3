"""The `birkhoff` command line: argument parsing only, one module per command family.

Subcommands: `run`, `train`, `generate`, `eval`, `presets`, `consolidate`, `import-hf`, `export-hf`.
Each lives in its own module (run.py: warm-up then GRPO; hf.py: import-hf and export-hf);
config.py holds the flags that set a run's configuration and commands.py the parser and `main`.
`run` and `train` also run data-parallel under torchrun, where a bad launch stops every rank
with the same one-line error. Modules import nothing heavy at the top, so `birkhoff --help`
stays fast. Each command in more detail: docs/training.md.
Left out: benchmarks (scripts in benchmarks/, not subcommands).
"""

from birkhoff.cli.commands import SUBCOMMANDS, build_parser, main

__all__ = ["SUBCOMMANDS", "build_parser", "main"]
