"""The supervised training loop behind `birkhoff train`: preset in, metrics and checkpoint out.

Design choices:
- The loop is a plain function over (preset, out_dir); the CLI only parses arguments. Batches
  come from `batch_for_step(seed, step)`, the lr from `lr_at(step)`, so the run is a function of
  the preset and the seed (deterministic on CPU).
- `metrics.jsonl` gets one JSON object per logged step (every `log_every` steps, plus the first
  and the last), flushed as it is written, so a crashed run keeps its history.
- Held-out greedy exact match is measured before and after training on problems drawn from a
  different seed stream, via teacher forcing (see `answer_accuracy`): one forward pass, no
  generation, and equal to greedy decoding's exact match.
- The final checkpoint goes to `out_dir/checkpoint` (atomic, see checkpoint.py).
Left out: mid-run checkpoints and resume (the RL loop owns those), evaluation by sampling.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

from birkhoff.model.transformer import Transformer
from birkhoff.presets import Preset
from birkhoff.rl.tasks import Task, build_supervised_batch, get_task, sample_problems
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train.checkpoint import save_checkpoint
from birkhoff.train.data import batch_for_step, step_rng
from birkhoff.train.optim import build_optimizer
from birkhoff.train.recompute import build_model
from birkhoff.train.step import answer_accuracy, train_step

EVAL_SEED_OFFSET = 1_000_003  # eval problems come from a seed stream training never uses


class TrainSummary(NamedTuple):
    history: list[dict[str, float]]  # every step's metrics
    eval_before: float  # held-out greedy exact match before training
    eval_after: float
    checkpoint: Path


@torch.no_grad()
def evaluate(
    model: Transformer, task: Task, tokenizer: CharTokenizer, *, seed: int, num_problems: int
) -> float:
    """Greedy exact-match rate on `num_problems` held-out problems (teacher-forced argmax)."""
    model.eval()
    problems = sample_problems(task, step_rng(seed + EVAL_SEED_OFFSET, 0), num_problems)
    batch = build_supervised_batch(problems, tokenizer).to(next(model.parameters()).device)
    logits_BTV = model(batch.input_ids).logits
    return float(answer_accuracy(logits_BTV, batch.input_ids, batch.loss_mask)[1])


def window_mean(history: list[dict[str, float]], key: str, *, last: bool) -> float:
    """Mean of `key` over the first (or last) fifth of the run, at most 20 steps."""
    values = [h[key] for h in history if key in h]
    k = max(1, min(20, len(values) // 5))
    window = values[-k:] if last else values[:k]
    return sum(window) / max(len(window), 1)


def progress_postfix(metrics: dict[str, float]) -> dict[str, str]:
    shown = {"main": "main_loss", "mtp": "mtp_loss", "acc": "seq_acc"}
    return {label: f"{metrics[key]:.3f}" for label, key in shown.items() if key in metrics}


def run_training(
    preset: Preset, out_dir: Path, *, device: torch.device, progress: bool = True
) -> TrainSummary:
    """Train `preset` on its task; write metrics.jsonl and checkpoint/ under `out_dir`."""
    cfg = preset.train
    tokenizer, task = CharTokenizer(), get_task(preset.task, **preset.task_options)
    torch.manual_seed(cfg.seed)
    model = build_model(preset.model, cfg, device=device)
    optimizer = build_optimizer(model, cfg)
    eval_before = evaluate(model, task, tokenizer, seed=cfg.seed, num_problems=256)
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    bar = tqdm(range(cfg.num_steps), desc=f"train {preset.name}", disable=not progress)
    with open(out_dir / "metrics.jsonl", "w") as log:
        for step in bar:
            batch = batch_for_step(task, tokenizer, batch_size=cfg.batch_size, seed=cfg.seed,
                                   step=step).to(device)  # fmt: skip
            metrics = train_step(model, optimizer, batch, cfg, step=step)
            history.append(metrics)
            if step % cfg.log_every == 0 or step == cfg.num_steps - 1:
                record: dict[str, Any] = {"step": step, **metrics}
                record["elapsed_s"] = round(time.perf_counter() - start, 3)
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.set_postfix(progress_postfix(metrics))
    eval_after = evaluate(model, task, tokenizer, seed=cfg.seed, num_problems=256)
    extra = {"preset": preset.name, "task": preset.task, "task_options": preset.task_options,
             "seed": cfg.seed, "eval_exact_match": eval_after}  # fmt: skip
    path = save_checkpoint(
        out_dir / "checkpoint", model, optimizer, step=cfg.num_steps, extra=extra
    )
    return TrainSummary(history, eval_before, eval_after, path)


def summary_lines(summary: TrainSummary) -> list[str]:
    """Human-readable first-vs-last figures printed at the end of `birkhoff train`."""
    lines = []
    for label, key in (("main loss", "main_loss"), ("mtp loss", "mtp_loss")):
        if any(key in h for h in summary.history):
            first = window_mean(summary.history, key, last=False)
            last = window_mean(summary.history, key, last=True)
            lines.append(f"{label:<10} first {first:.4f} -> last {last:.4f}")
    lines.append(
        f"held-out greedy exact match {summary.eval_before:.3f} -> {summary.eval_after:.3f}"
    )
    lines.append(f"checkpoint  {summary.checkpoint}")
    return lines
