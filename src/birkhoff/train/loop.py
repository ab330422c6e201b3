"""The supervised loop, shared by `birkhoff train` and the warm-up of `birkhoff run`.

`supervised_steps` is the one supervised loop, a generator (the batch of (seed, step), one
`train_step`, one metrics row), so each caller decides what happens between steps.
`SupervisedRun` is `birkhoff train`: a function of (ModelConfig, TrainConfig, Task) and the seed
(presets are the command line's business) that logs, checkpoints every `checkpoint_every` steps
into `out_dir/checkpoint` (sharded under torchrun), stops at a step boundary on a signal
(runtime.stop) and resumes from its checkpoint with the metrics of an uninterrupted run, as
`birkhoff run` does (runtime.resume). Evaluation here is teacher-forced
(`teacher_forced_accuracy`: greedy decoding's exact match in one forward); the summary's loss
windows and the first evaluation travel in the checkpoint (`LossWindows`).
`TrainConfig.cuda_graph` replays each step from a CUDA graph (train/graph.py).
Design choices in detail: docs/training.md.
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
from birkhoff.runtime.checkpoint import CheckpointError
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
from birkhoff.runtime.resume import load_run_checkpoint, save_run_checkpoint, stop_reason
from birkhoff.runtime.stop import StopFlag
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


CHECKPOINT_DIR = "checkpoint"
JOB = "train"  # the checkpoint's `job`: `birkhoff run` does not resume it, nor the reverse


class TrainSummary(NamedTuple):
    losses: dict[str, tuple[float, float]]  # key -> (mean of the first, of the last window)
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


class LossWindows:
    """The first and the last `size` values of each loss (a fifth of the run, at most 20), for
    the summary's first-vs-last figures; `state` goes into the checkpoint, so a resumed run
    prints what the uninterrupted one would."""

    KEYS = ("main_loss", "mtp_loss")

    def __init__(self, num_steps: int) -> None:
        self.size = max(1, min(20, num_steps // 5))
        self.first: dict[str, list[float]] = {}
        self.last: dict[str, list[float]] = {}

    def add(self, row: dict[str, Any]) -> None:
        for key in self.KEYS:
            if key in row:
                first = self.first.setdefault(key, [])
                if len(first) < self.size:
                    first.append(row[key])
                self.last[key] = [*self.last.get(key, []), row[key]][-self.size :]

    def means(self) -> dict[str, tuple[float, float]]:
        return {k: (mean(v), mean(self.last[k])) for k, v in self.first.items()}

    def state(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last}

    def restore(self, state: dict[str, Any]) -> None:
        self.first = {k: list(v) for k, v in state.get("first", {}).items()}
        self.last = {k: list(v)[-self.size :] for k, v in state.get("last", {}).items()}


def mean(values: Sequence[float]) -> float:
    return sum(values) / max(len(values), 1)


class SupervisedRun:
    """State of one `birkhoff train` run: model, optimizer, step, metrics log, counters.

    Build it (a fresh model from `cfg.seed`), `resume()` to continue the run in `out_dir`, then
    `run()`. `extra` goes into every checkpoint's metadata (the command line records the preset
    and its resolved settings there).
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: TrainConfig,
        task: Task,
        out_dir: Path,
        *,
        device: torch.device,
        name: str = "train",
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.dist, self.cfg, self.task, self.name = current(), cfg, task, name
        check_world_size(self.dist.world_size, cfg.batch_size, "batch_size")
        self.out, self.extra, self.tokenizer = Path(out_dir), dict(extra or {}), CharTokenizer()
        torch.manual_seed(cfg.seed)
        self.model = build_model(model_cfg, cfg, device=device)
        if self.dist.enabled:
            shard_model(self.model, device_type=device.type, amp_dtype=cfg.amp_dtype)
        self.optimizer = build_optimizer(self.model, cfg)
        self.held_out = sample_problems(task, held_out_rng(cfg.seed), NUM_EVAL_PROBLEMS)
        self.eval_before = teacher_forced_accuracy(self.model, self.held_out, self.tokenizer)
        self.log = MetricsLog(self.out / "metrics.jsonl")
        self.skips, self.windows = SkipCounter(cfg.max_skipped_in_row), LossWindows(cfg.num_steps)
        self.step = 0  # steps completed
        self.checkpoint_step: int | None = None  # the step the run's checkpoint holds
        self.stopped_by: str | None = None  # why the last `run` ended early (runtime.stop)

    @property
    def checkpoint(self) -> Path:
        return self.out / CHECKPOINT_DIR

    def save(self, **final: Any) -> Path:
        extra = {**self.extra, "job": JOB, "seed": self.cfg.seed, "eval_before": self.eval_before}
        extra.update(losses=self.windows.state(), **self.skips.state(), **final)
        path = save_run_checkpoint(
            self.checkpoint,
            self.model,
            self.optimizer,
            step=self.step,
            extra=extra,
            sharded=self.dist.enabled,
        )
        self.checkpoint_step = self.step
        return path

    def resume(self) -> None:
        """Restore model, optimizer, RNG, step and counters from the run's checkpoint; drop the
        metrics rows after it (the resumed run writes them again)."""
        step, extra = load_run_checkpoint(
            self.checkpoint, self.model, self.optimizer, sharded=self.dist.enabled
        )
        if extra.get("job") != JOB:
            raise CheckpointError(
                f"{self.checkpoint} holds a `birkhoff {extra.get('job', 'run')}` run; "
                "`birkhoff train` resumes only its own"
            )
        self.step = self.checkpoint_step = step
        self.eval_before = float(extra["eval_before"])
        self.skips.restore(extra)
        self.windows.restore(extra.get("losses", {}))
        if self.dist.is_main:
            self.log.truncate_after(step)

    def run(
        self, *, stop: StopFlag | None = None, stop_after: int | None = None, progress: bool = True
    ) -> TrainSummary | None:
        """Train (or go on) to `cfg.num_steps`, then evaluate and write the final checkpoint.

        Ends early, with a checkpoint of the steps done and None returned, after step
        `stop_after` or at the first step boundary after `stop` was raised; `stopped_by` then
        says which.
        """
        cfg, self.stopped_by = self.cfg, None
        steps = range(self.step, cfg.num_steps)
        rows = supervised_steps(
            self.model, self.optimizer, self.task, self.tokenizer, cfg, steps=steps
        )
        enabled = progress and self.dist.is_main
        bar = Progress(
            total=cfg.num_steps, initial=self.step, desc=f"train {self.name}", enabled=enabled
        )
        with bar:
            while self.step < cfg.num_steps:
                self.stopped_by = stop_reason(
                    stop,
                    stop_after,
                    step=self.step,
                    distributed=self.dist.enabled,
                    device=model_device(self.model),
                )
                if self.stopped_by is not None:
                    if self.checkpoint_step != self.step:
                        self.save()
                    return None
                self.finish_step(next(rows), bar)
        eval_after = teacher_forced_accuracy(self.model, self.held_out, self.tokenizer)
        path = self.save(eval_exact_match=eval_after)
        return TrainSummary(self.windows.means(), self.eval_before, eval_after, path)

    def finish_step(self, row: dict[str, Any], bar: Progress) -> None:
        """After a step: count, log when due, checkpoint when due."""
        cfg, step = self.cfg, row["step"]
        self.step += 1
        self.skips.count(row)
        self.windows.add(row)
        due = step % cfg.log_every == 0 or self.step == cfg.num_steps or row["skipped"]
        if self.dist.is_main and due:
            self.log.append(row)
        bar.update({k: f"{row[k]:.3f}" for k in ("main_loss", "mtp_loss", "seq_acc") if k in row})
        self.skips.check(step, checkpoint=self.checkpoint, checkpoint_step=self.checkpoint_step)
        every = cfg.checkpoint_every
        if every > 0 and self.step % every == 0 and self.step < cfg.num_steps:
            self.save()


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
    """Train a fresh `model_cfg` model on `task` to the end; metrics.jsonl and checkpoint/ under
    `out_dir` (a previous metrics.jsonl there is replaced)."""
    run = SupervisedRun(model_cfg, cfg, task, out_dir, device=device, name=name, extra=extra)
    if run.dist.is_main:
        run.log.path.unlink(missing_ok=True)
    run.log.trackers = list(trackers)
    with closing(run.log):  # the trackers too
        summary = run.run(progress=progress)
    assert summary is not None  # no stop was asked for
    return summary


def summary_lines(summary: TrainSummary) -> list[str]:
    """Human-readable first-vs-last figures printed at the end of `birkhoff train`."""
    lines = []
    for label, key in (("main loss", "main_loss"), ("mtp loss", "mtp_loss")):
        if key in summary.losses:
            first, last = summary.losses[key]
            lines.append(f"{label:<10} first {first:.4f} -> last {last:.4f}")
    lines.append(
        f"held-out greedy exact match {summary.eval_before:.3f} -> {summary.eval_after:.3f}"
    )
    lines.append(f"checkpoint  {summary.checkpoint}")
    return lines
