"""The supervised loop, shared by `birkhoff train` and the warm-up of `birkhoff run`.

`supervised_steps` is the one supervised loop, a generator (the batch of (seed, step), one
`train_step`, one metrics row), so each caller decides what happens between steps. The run is a
function of (ModelConfig, TrainConfig, Task) and the seed; presets are the command line's
business. Evaluation here is teacher-forced (`teacher_forced_accuracy`: greedy decoding's exact
match in one forward). The final checkpoint goes to `out_dir/checkpoint` (sharded under
torchrun); `TrainConfig.cuda_graph` replays each step from a CUDA graph (train/graph.py).
Design choices in detail: docs/training.md.
Left out: mid-run checkpoints and resume of `birkhoff train` (the GRPO run has both).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from birkhoff.config import ModelConfig
from birkhoff.runtime.checkpoint import save_checkpoint
from birkhoff.runtime.dcp import save_sharded
from birkhoff.runtime.distributed import (
    check_world_size,
    current,
    rank_share,
    reduce_floats,
    shard_model,
    take_rows,
)
from birkhoff.runtime.metrics import MetricsLog, memory_metrics, reset_peak_memory
from birkhoff.runtime.progress import Progress
from birkhoff.tasks.batches import batch_for_step, build_supervised_batch
from birkhoff.tasks.problems import Problem, Task, held_out_rng, sample_problems
from birkhoff.tokenizer import CharTokenizer, Tokenizer
from birkhoff.train.config import TrainConfig
from birkhoff.train.graph import StepGraphs, bucketed_length
from birkhoff.train.optim import build_optimizer
from birkhoff.train.recompute import build_model
from birkhoff.train.step import (
    SkipCounter,
    answer_accuracy,
    model_device,
    supervised_loss,
    train_step,
)

if TYPE_CHECKING:
    from birkhoff.runtime.tracking import Tracker

NUM_EVAL_PROBLEMS = 256


class TrainSummary(NamedTuple):
    history: list[dict[str, Any]]  # every step's metrics row
    eval_before: float  # held-out teacher-forced exact match before training
    eval_after: float
    checkpoint: Path


def supervised_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    task: Task,
    tokenizer: Tokenizer,
    cfg: TrainConfig,
    *,
    steps: range,
) -> Iterator[dict[str, Any]]:
    """Run the supervised steps `steps`, yielding each one's metrics row (phase "sft")."""
    device, ctx = model_device(model), current()
    rows = rank_share(cfg.batch_size, ctx.rank, ctx.world_size)
    graphs = StepGraphs(model, supervised_loss, cfg) if cfg.cuda_graph else None
    model_cfg = model.cfg
    assert isinstance(model_cfg, ModelConfig), "the supervised loop needs a model carrying .cfg"
    for step in steps:
        reset_peak_memory(device)
        batch = batch_for_step(task, tokenizer, batch_size=cfg.batch_size, seed=cfg.seed, step=step)
        batch = (take_rows(batch, rows) if ctx.world_size > 1 else batch).to(device)
        if graphs is not None:  # few lengths, few graphs
            length = bucketed_length(batch.input_ids.shape[1], model_cfg.max_seq_len)
            batch = batch.padded(length, tokenizer.pad_id)
        start = time.perf_counter()
        metrics = train_step(model, optimizer, batch, cfg, step=step, graphs=graphs)
        timings = {"train_s": time.perf_counter() - start, **memory_metrics(device)}
        yield {"phase": "sft", "step": step, **metrics, **reduce_floats(timings, "max", device)}


@torch.no_grad()
def teacher_forced_accuracy(
    model: nn.Module, problems: Sequence[Problem], tokenizer: Tokenizer
) -> float:
    """Exact-match rate of the argmax answers given the true prefix (= greedy exact match)."""
    model.eval()
    batch = build_supervised_batch(problems, tokenizer).to(model_device(model))
    out = model(batch.input_ids, labels=batch.input_ids, loss_mask=batch.loss_mask)
    return float(answer_accuracy(out.argmax, batch.input_ids, batch.loss_mask)[1])


def run_training(
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    task: Task,
    out_dir: Path,
    *,
    device: torch.device,
    progress: bool = True,
    name: str = "train",
    extra: dict[str, Any] | None = None,
    trackers: Sequence[Tracker] = (),
) -> TrainSummary:
    """Train a fresh `model_cfg` model on `task`; write metrics.jsonl and checkpoint/ under
    `out_dir`. `name` labels the progress bar; `extra` goes into the checkpoint's metadata."""
    ctx = current()
    check_world_size(ctx.world_size, cfg.batch_size, "batch_size")
    tokenizer = CharTokenizer()
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg, cfg, device=device)
    if ctx.enabled:
        shard_model(model, device_type=device.type, amp_dtype=cfg.amp_dtype)
    optimizer = build_optimizer(model, cfg)
    held_out = sample_problems(task, held_out_rng(cfg.seed), NUM_EVAL_PROBLEMS)
    eval_before = teacher_forced_accuracy(model, held_out, tokenizer)
    if ctx.is_main:
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    log, history = MetricsLog(out_dir / "metrics.jsonl", trackers=trackers), []
    rows = supervised_steps(model, optimizer, task, tokenizer, cfg, steps=range(cfg.num_steps))
    enabled, skips = progress and ctx.is_main, SkipCounter(cfg.max_skipped_in_row)
    bar = Progress(total=cfg.num_steps, desc=f"train {name}", enabled=enabled)
    with bar, closing(log):  # the trackers too
        for row in rows:
            history.append(row)
            step = row["step"]
            skips.count(row)
            due = step % cfg.log_every == 0 or step == cfg.num_steps - 1 or row["skipped"]
            if ctx.is_main and due:
                log.append(row)
            bar.update(
                {k: f"{row[k]:.3f}" for k in ("main_loss", "mtp_loss", "seq_acc") if k in row}
            )
            skips.check(step, checkpoint=out_dir / "checkpoint", checkpoint_step=None)
    eval_after = teacher_forced_accuracy(model, held_out, tokenizer)
    meta = {**(extra or {}), "seed": cfg.seed, "eval_exact_match": eval_after}
    save = save_sharded if ctx.enabled else save_checkpoint
    path = save(out_dir / "checkpoint", model, optimizer, step=cfg.num_steps, extra=meta)
    return TrainSummary(history, eval_before, eval_after, path)


def window_mean(history: list[dict[str, Any]], key: str, *, last: bool) -> float:
    """Mean of `key` over the first (or last) fifth of the run, at most 20 steps."""
    values = [h[key] for h in history if key in h]
    k = max(1, min(20, len(values) // 5))
    window = values[-k:] if last else values[:k]
    return sum(window) / max(len(window), 1)


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
