"""`birkhoff eval`: a checkpoint (of a run, or an imported model) on a task or a JSONL file.

The figures come from the run's own held-out evaluation (birkhoff.rl.evaluate): pass@1 greedy,
pass@k of seeded samples, mean greedy and sampled reward, MTP acceptance, tokens/s. Settings:
those the checkpoint recorded (else --preset's, for an imported model), then --config / --set
and the dedicated flags; the model config is the checkpoint's. Problems: the run's held-out set
(rl.num_eval_prompts from held_out_rng(train.seed), so a run's checkpoint gives back the run's
eval figures at that step), a generated task (--task) or every line of a JSONL file (--data).
Writes OUT/completions.jsonl (one object per completion) and OUT/figures.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from birkhoff.cli.common import UsageError, prepare_out_dir, resolve_device
from birkhoff.cli.config import add_config_arguments, settings_overrides

if TYPE_CHECKING:
    from birkhoff.presets import Preset
    from birkhoff.tasks.problems import Problem, Task
    from birkhoff.tokenizer import Tokenizer

OUTPUTS = ("completions.jsonl", "figures.json")
FLAGS = {  # dedicated flag -> setting
    "num_problems": "rl.num_eval_prompts",
    "samples": "rl.group_size",
    "temperature": "rl.temperature",
    "max_new_tokens": "rl.max_new_tokens",
    "speculative": "rl.num_speculative_tokens",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory")
    parser.add_argument(
        "--preset",
        default="tiny-cpu",
        help="settings when the checkpoint recorded none (an imported model)",
    )
    parser.add_argument("--task", default=None, help="a generated task instead of the run's")
    parser.add_argument("--data", type=Path, default=None, help="JSONL file: every line a problem")
    parser.add_argument(
        "--verifier", default=None, help="with --data: exact | numeric[:TOL] | module:fn"
    )
    parser.add_argument(
        "--num-problems",
        type=int,
        default=None,
        help="rl.num_eval_prompts (--data: every line unless given)",
    )
    parser.add_argument(
        "--samples", type=int, default=None, help="rl.group_size: samples per problem for pass@k"
    )
    parser.add_argument("--temperature", type=float, default=None, help="rl.temperature")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="rl.max_new_tokens")
    parser.add_argument(
        "--speculative",
        type=int,
        default=None,
        help="rl.num_speculative_tokens (MTP drafts per step)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: the checkpoint's sibling eval/)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a previous evaluation")
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: cuda when available",
    )
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from birkhoff.runtime.dcp import is_sharded_checkpoint

    if not args.checkpoint.is_dir():
        raise UsageError(f"--checkpoint {args.checkpoint}: no such checkpoint directory")
    if is_sharded_checkpoint(args.checkpoint):
        raise UsageError(
            f"--checkpoint {args.checkpoint}: a sharded checkpoint; run `birkhoff "
            "consolidate --checkpoint DIR --out NEW_DIR` first"
        )
    device = resolve_device(args.device)
    try:
        preset, task, problems, tokenizer = eval_inputs(args)
    except ValueError as err:
        raise UsageError(str(err)) from err
    out = args.out or args.checkpoint.resolve().parent / "eval"
    prepare_out_dir(out, overwrite=args.overwrite, outputs=OUTPUTS)

    import torch

    from birkhoff.engine import Engine
    from birkhoff.rl.evaluate import completion_records, eval_figures, evaluate
    from birkhoff.runtime.checkpoint import load_checkpoint

    rl = preset.rl
    assert rl is not None
    model = load_checkpoint(args.checkpoint).model.eval()
    engine = Engine.from_model(
        model,
        device=device,
        dtype=torch.bfloat16 if device == "cuda" else torch.float32,
        quantize=rl.refit_quantize,
        max_batch_size=min(len(problems) * rl.group_size, 256),
        max_speculative_tokens=max(rl.num_speculative_tokens, 1),
    )
    ev = evaluate(engine, problems, task, tokenizer, rl, seed=args.seed)
    figures = eval_figures(ev, torch.device(device))
    with open(out / "completions.jsonl", "w", encoding="utf-8") as f:
        for record in completion_records(ev, problems):
            f.write(json.dumps(record) + "\n")
    about = {
        "checkpoint": str(args.checkpoint),
        "task": preset.task if args.data is None else str(args.data),
        "num_problems": len(problems),
        "samples": rl.group_size,
        "temperature": rl.temperature,
        "max_new_tokens": rl.max_new_tokens,
        "speculative": rl.num_speculative_tokens,
        "seed": args.seed,
    }
    (out / "figures.json").write_text(json.dumps({**about, **figures}, indent=2) + "\n")
    for line in summary_lines(figures, out):
        print(line)
    return 0


def eval_inputs(args: argparse.Namespace) -> tuple[Preset, Task, list[Problem], Tokenizer]:
    """The settings, task, problems and tokenizer of an evaluation; ValueError naming the flag."""
    from birkhoff.overrides import apply
    from birkhoff.presets import get_preset
    from birkhoff.rl.config import RLConfig
    from birkhoff.rl.inputs import run_inputs
    from birkhoff.tasks.problems import get_task, held_out_rng, sample_problems

    if args.data is not None and args.task is not None:
        raise ValueError("--task and --data are exclusive: one task per evaluation")
    if args.verifier is not None and args.data is None:
        raise ValueError("--verifier needs --data FILE.jsonl")
    preset = apply(get_preset(args.preset), recorded_settings(args.checkpoint))
    if preset.rl is None:  # a supervised-only preset: the RL config's sampling defaults
        preset = preset.replace(rl=RLConfig())
    preset = apply(preset, settings_overrides(args, FLAGS))
    preset, inputs = run_inputs(
        preset, init=args.checkpoint, task=args.task, max_new_tokens=args.max_new_tokens
    )
    tokenizer = inputs["tokenizer"]
    assert preset.rl is not None
    if args.data is not None:
        from birkhoff.tasks.jsonl import load_jsonl_tasks

        every = load_jsonl_tasks(
            args.data,
            verifier=args.verifier or "exact",
            eval_path=args.data,
            tokenizer=tokenizer,
            max_seq_len=preset.model.max_seq_len,
        ).eval
        limit = args.num_problems or len(every.problems)
        return preset, every, list(every.problems)[:limit], tokenizer
    task = get_task(preset.task, **preset.task_options)
    problems = sample_problems(task, held_out_rng(preset.train.seed), preset.rl.num_eval_prompts)
    if not problems:
        raise ValueError("no problems to evaluate: --num-problems must be >= 1")
    return preset, task, problems, tokenizer


def recorded_settings(checkpoint: Path) -> list[Any]:
    """The settings a run's checkpoint recorded (not its model: config.json is that) as
    overrides; [] for a checkpoint without them (an imported model)."""
    from birkhoff.overrides import Override, flatten, known_path
    from birkhoff.runtime.dcp import checkpoint_extra

    extra = checkpoint_extra(checkpoint)
    recorded = extra.get("config")
    if not isinstance(recorded, dict):
        return []
    label = f"{checkpoint}/meta.json"
    return [
        Override(k, v, f"{label}: {k}")
        for k, v in flatten(recorded).items()
        if not k.startswith("model.") and known_path(k)
    ]


def summary_lines(figures: dict[str, float], out: Path) -> list[str]:
    passes = ", ".join(f"{k} {v:.3f}" for k, v in figures.items() if k.startswith("pass@"))
    return [
        passes,
        f"mean reward: greedy {figures['eval_reward']:.3f}, sampled "
        f"{figures['eval_sampled_reward']:.3f}",
        f"tokens/s: greedy {figures['greedy_tokens_s']:.0f}, sampled "
        f"{figures['sampled_tokens_s']:.0f}",
        f"outputs: {out}/figures.json, {out}/completions.jsonl",
    ]
