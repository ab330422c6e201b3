"""The `birkhoff` command line: argument parsing only, one module per command family.

Subcommands: `run`, `train`, `generate`, `eval`, `presets`, `consolidate`, `import-hf`, `export-hf`.
- `run` (run.py): the main job, a supervised warm-up then GRPO with the engine in the loop (a
  preset's task or a JSONL file, from a fresh model or a checkpoint: birkhoff.rl.inputs);
- `train` (train.py): supervised training only;
- `generate` (generate.py): complete prompts with a checkpoint;
- `eval` (evaluate.py): a checkpoint's pass@1 / pass@k / reward on a task or a JSONL file;
- `presets` (presets.py): the presets, one line each, or one's settings as TOML;
- `consolidate` (consolidate.py): a sharded (torchrun) checkpoint as one directory;
- `import-hf` / `export-hf` (hf.py): HuggingFace Llama-family checkpoints in and out.
config.py: the flags that set a run's configuration (--config, --set, --PATH).
commands.py builds the parser and holds `main` (the `birkhoff` console script; `python -m
birkhoff`). Benchmarks are scripts in benchmarks/, not subcommands.

`run` and `train` also run data-parallel: `torchrun --nproc-per-node N -m birkhoff run ...`
starts one process per device (birkhoff.runtime.distributed). A bad launch (a CPU run asking
for NCCL, more processes than prompts or rows per step, ranks given different presets or flags,
an output directory one rank cannot use) stops every rank with the same one-line error.
Progress goes to stdout: a bar on a terminal, a plain line every few steps otherwise.
Modules import nothing heavy at the top, so `birkhoff --help` stays fast.
"""

from birkhoff.cli.commands import SUBCOMMANDS, build_parser, main

__all__ = ["SUBCOMMANDS", "build_parser", "main"]
