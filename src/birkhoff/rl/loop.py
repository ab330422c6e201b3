"""The main job: supervised warm-up, then GRPO with the engine in the loop, every seam exercised.

One GRPO step:
    rollout (engine, MTP speculative decoding) -> rewards -> group advantages
    -> `updates_per_step` training steps (full recompute + safe reclaim, staleness checked)
    -> refit session (buckets, one completeness check, atomic commit; weight_version += 1)
The MTP loss stays on so the drafter follows the policy. The warm-up is `birkhoff train`'s
supervised loop; evaluation generates with the engine (rl/evaluate.py). Every random choice is a
function of (seed, step), so a resumed run repeats the uninterrupted one (on CPU). Under
torchrun the model is sharded with FSDP2, each rank rolls out and trains on whole groups and
refits its engine from the shards. Determinism and the distributed run: docs/grpo.md.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from birkhoff.config import resolve_kernels
from birkhoff.engine import Engine
from birkhoff.model.hyper import apply_kernels
from birkhoff.model.mtp import shift_targets
from birkhoff.model.transformer import Transformer
from birkhoff.overrides import as_settings
from birkhoff.presets import Preset
from birkhoff.refit.api import refit
from birkhoff.refit.session import RefitReport
from birkhoff.rl.advantage import group_advantages
from birkhoff.rl.config import RLConfig
from birkhoff.rl.evaluate import eval_metrics, evaluate
from birkhoff.rl.loss import grpo_loss
from birkhoff.rl.mtp_warmup import self_distill_steps
from birkhoff.rl.reduce import rollout_metrics
from birkhoff.rl.rollout import RLBatch, build_rl_batch, check_staleness, rollout
from birkhoff.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from birkhoff.runtime.distributed import (
    check_world_size,
    current,
    global_share,
    global_sum,
    reduce_floats,
    shard_model,
    take,
    world_size,
)
from birkhoff.runtime.metrics import MetricsLog, memory_metrics, reset_peak_memory
from birkhoff.runtime.progress import Progress
from birkhoff.runtime.resume import load_run_checkpoint, save_run_checkpoint, stop_reason
from birkhoff.runtime.stop import StopFlag
from birkhoff.tasks.problems import (
    Problem,
    Task,
    get_task,
    held_out_rng,
    sample_problems,
    sampling_seed,
    step_rng,
)
from birkhoff.tokenizer import CharTokenizer, Tokenizer
from birkhoff.train.loop import supervised_steps
from birkhoff.train.optim import build_optimizer
from birkhoff.train.recompute import build_model
from birkhoff.train.step import LossFn, Metrics, SkipCounter, train_step

CHECKPOINT_DIR = "checkpoint"
SEED_STRIDE = 1 << 20  # rank r samples with seed + r * SEED_STRIDE (rank 0: the plain seed)
REFERENCE_DIR = "reference"  # frozen policy at the start of GRPO (only with a KL weight)


def grpo_loss_fn(cfg: RLConfig, reference: nn.Module | None = None) -> LossFn:
    """GRPO policy loss on the completion tokens (+ KL to `reference`) + the MTP loss."""

    def loss_fn(model: nn.Module, batch: RLBatch) -> tuple[Tensor, Metrics]:
        # the rollouts sampled from softmax(logits / temperature): the ratio uses the same
        ids_BT, mask_BT, t = batch.input_ids, batch.completion_mask, cfg.temperature
        out = model(ids_BT, labels=ids_BT, loss_mask=mask_BT, temperature=t)
        # out.logp[:, i] is the logprob of token i+1: align [:, :-1] with tokens/masks[:, 1:]
        logp_BT = out.logp[:, :-1]
        ref_logp_BT = None
        if reference is not None:
            with torch.no_grad():
                ref = reference(ids_BT, labels=ids_BT, loss_mask=mask_BT, temperature=t)
            ref_logp_BT = ref.logp[:, :-1]
        num_ranks = world_size()
        policy_loss, metrics = grpo_loss(
            logp_BT,
            batch.rollout_logp[:, 1:],
            batch.advantages,
            mask_BT[:, 1:],
            cfg.loss,
            ref_logp_BT=ref_logp_BT,
            num_tokens=global_sum(mask_BT[:, 1:].sum()) if num_ranks > 1 else None,
        )
        mtp_losses = out.mtp_losses
        if num_ranks > 1:  # each depth's share of its global token mean
            counts = [
                shift_targets(batch.input_ids, mask_BT, k + 1)[1].sum()
                for k in range(1, len(mtp_losses) + 1)
            ]
            mtp_losses = [global_share(x, n) for x, n in zip(mtp_losses, counts, strict=True)]
        mtp_loss = torch.stack(mtp_losses).mean() if mtp_losses else policy_loss * 0
        result: Metrics = dict(metrics)
        # shares times the world size: train_step's mean over ranks is then the global value
        result.update(
            policy_loss=policy_loss.detach() * num_ranks, mtp_loss=mtp_loss.detach() * num_ranks
        )
        return policy_loss + cfg.mtp_loss_weight * mtp_loss, result

    return loss_fn


class GRPORun:
    """State of one run: model, optimizer, engine, step counters, output directory.

    By default the preset says everything: its task, the character tokenizer, a fresh model and
    held-out problems from `held_out_rng`. `task` + `eval_problems` replace the task (a JSONL
    file's splits), `tokenizer` the tokenizer, and `init` a checkpoint whose weights the model
    starts from (its config must be the preset's model config).
    """

    def __init__(
        self,
        preset: Preset,
        out_dir: str | Path,
        *,
        device: str = "cpu",
        task: Task | None = None,
        eval_problems: Sequence[Problem] | None = None,
        tokenizer: Tokenizer | None = None,
        init: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(preset.rl, RLConfig):
            raise ValueError(f"preset {preset.name!r} has no RL config (preset.rl is None)")
        self.preset, self.rl, self.device = preset, preset.rl, torch.device(device)
        self.dist = current()
        check_world_size(self.dist.world_size, self.rl.num_prompts, "num_prompts")
        if self.dist.enabled and self.rl.loss.kl_weight > 0:
            raise ValueError(
                f"kl_weight={self.rl.loss.kl_weight}: the KL reference is not "
                "supported under torchrun; use kl_weight=0"
            )
        if self.dist.enabled and self.rl.warmup == "mtp-self-distill":
            raise ValueError(
                "warmup='mtp-self-distill' is not supported under torchrun: it freezes the main "
                "model, which FSDP2 shards"
            )
        self.out = Path(out_dir)
        self.tokenizer: Tokenizer = CharTokenizer() if tokenizer is None else tokenizer
        self.task: Task = get_task(preset.task, **preset.task_options) if task is None else task
        torch.manual_seed(preset.train.seed)
        self.model = build_model(preset.model, preset.train, device=self.device)
        if init is not None:
            load_checkpoint(init, model=self.model)
        self.reference: Transformer | None = None  # frozen start-of-GRPO policy, for the KL
        self.step = 0  # global: warm-up steps, then GRPO steps
        self.checkpoint_step: int | None = None  # the step the run's checkpoint holds
        self.stopped_by: str | None = None  # why the last `run` ended early (runtime.stop)
        self.skips = SkipCounter(preset.train.max_skipped_in_row)  # non-finite steps
        self.trainer_version = 0  # optimizer updates since the engine's weights were taken
        self.engine = self.build_engine()  # from the whole model, before any sharding
        if self.dist.enabled:
            shard_model(self.model, device_type=self.device.type, amp_dtype=preset.train.amp_dtype)
        self.optimizer = build_optimizer(self.model, preset.train)
        self.log = MetricsLog(self.out / "metrics.jsonl")
        if eval_problems is None:
            held_out = held_out_rng(preset.train.seed)
            eval_problems = sample_problems(self.task, held_out, self.rl.num_eval_prompts)
        self.eval_problems = list(eval_problems)[: self.rl.num_eval_prompts]

    @property
    def total_steps(self) -> int:
        return self.rl.warmup_steps + self.rl.num_steps

    def build_engine(self) -> Engine:
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        batch = min(self.rl.num_prompts * self.rl.group_size, 256)
        return Engine.from_model(
            self.model,
            device=self.device,
            dtype=dtype,
            quantize=self.rl.refit_quantize,
            max_batch_size=max(batch, self.rl.num_eval_prompts, 1),
            max_speculative_tokens=max(self.rl.num_speculative_tokens, 1),
            kernels=self.preset.train.kernels,
        )

    # ------------------------------------------------------------------ phases

    def step_rows(self) -> Iterator[dict[str, Any]]:
        """Each remaining step's metrics row, computed when asked for: the rest of the
        supervised warm-up (the shared loop), then GRPO steps."""
        # the warm-up's lr schedule spans the warm-up, not the preset's supervised run length
        cfg = self.preset.train.replace(num_steps=max(self.rl.warmup_steps, 1))
        steps = range(self.step, self.rl.warmup_steps)
        if self.rl.warmup == "mtp-self-distill":
            yield from self_distill_steps(
                self.model,
                self.optimizer,
                self.engine,
                self.task,
                self.tokenizer,
                cfg,
                self.rl,
                steps=steps,
            )
        else:
            yield from supervised_steps(
                self.model, self.optimizer, self.task, self.tokenizer, cfg, steps=steps
            )
        while True:
            yield self.grpo_step()

    def grpo_step(self) -> dict[str, Any]:
        rl, seed = self.rl, self.preset.train.seed
        reset_peak_memory(self.device)
        if rl.loss.kl_weight > 0 and self.reference is None:
            self.reference = self.freeze_reference()
        problems = sample_problems(self.task, step_rng(seed, self.step), rl.num_prompts)
        ro = rollout(
            self.engine,
            take(problems, self.dist),
            self.task,
            self.tokenizer,
            rl,
            seed=self.rank_seed(sampling_seed(seed, self.step)),
        )
        adv_QW = group_advantages(ro.rewards_QW, normalize_std=rl.normalize_adv_std)
        batch = build_rl_batch(ro, adv_QW, pad_id=self.tokenizer.pad_id).to(self.device)
        metrics, train_s = self.update(batch)
        report = self.refit()
        timings = {"train_s": train_s, "refit_s": report.seconds, **memory_metrics(self.device)}
        slowest = reduce_floats(timings, "max", self.device)  # every rank refits the same bytes
        slowest["refit_gb_s"] = report.bytes / max(slowest["refit_s"], 1e-9) / 1e9
        return {
            "phase": "grpo",
            "step": self.step,
            **rollout_metrics(ro, self.device),
            **metrics,
            **slowest,
            "weight_version": report.version,
        }

    def rank_seed(self, seed: int) -> int:
        """This rank's sampling seed: `seed` itself on rank 0 (and in one process)."""
        return seed + self.dist.rank * SEED_STRIDE

    def update(self, batch: RLBatch) -> tuple[dict[str, float], float]:
        """`updates_per_step` optimizer steps on one rollout batch; (last metrics, seconds)."""
        rl = self.rl
        train_cfg = self.preset.train.replace(lr=rl.lr, warmup_steps=0, min_lr_ratio=1.0)
        loss_fn = grpo_loss_fn(rl, self.reference)
        start, metrics, skipped = time.perf_counter(), {}, 0.0
        for _ in range(rl.updates_per_step):
            version = self.engine_version_of_trainer()
            check_staleness(batch.weight_versions, version, rl.max_staleness)
            metrics = train_step(
                self.model, self.optimizer, batch, train_cfg, step=self.step, loss_fn=loss_fn
            )
            skipped += metrics["skipped"]
            self.trainer_version += 1
        return metrics | {"skipped": skipped}, time.perf_counter() - start

    def engine_version_of_trainer(self) -> int:
        """The version the trainer's weights would get at the next refit."""
        return self.engine.weight_version + self.trainer_version

    def refit(self) -> RefitReport:
        report = refit(
            self.model,
            self.engine,
            bucket_bytes=self.rl.refit_bucket_bytes,
            quantize=self.rl.refit_quantize,
        )
        self.trainer_version = 0
        return report

    def evaluate_generated(self) -> dict[str, float]:
        """Reward of the engine's completions on the fixed held-out problems: greedy and sampled.

        Greedy exact match is what a user sees; the sampled reward (temperature as in the
        rollouts, `group_size` seeded samples per problem) is what GRPO optimises and is far less
        noisy on a small eval set. Both are drafted by MTP; acceptance is logged for greedy.
        """
        if not self.eval_problems:
            return {}
        problems = take(self.eval_problems, self.dist)  # each rank evaluates its share
        ev = evaluate(
            self.engine, problems, self.task, self.tokenizer, self.rl, seed=self.rank_seed(0)
        )
        return eval_metrics(ev, self.device)  # the code of `birkhoff eval` (rl/evaluate.py)

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        extra = {
            "engine_version": self.engine.weight_version,
            "job": "run",
            "preset": self.preset.name,
            "config": as_settings(self.preset),
            **self.skips.state(),
        }  # the resolved settings, for --resume
        save_run_checkpoint(
            self.out / CHECKPOINT_DIR,
            self.model,
            self.optimizer,
            step=self.step,
            extra=extra,
            sharded=self.dist.enabled,
        )
        self.checkpoint_step = self.step

    def freeze_reference(self) -> Transformer:
        """A frozen copy of the current policy, saved atomically so a resumed run reuses it."""
        reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        save_checkpoint(self.out / REFERENCE_DIR, reference, step=self.step)
        return reference

    def resume(self) -> None:
        """Restore model, optimizer and step from the run's checkpoint; truncate the metrics.

        Under torchrun the checkpoint is sharded (any number of ranks may resume it) and the
        engine is refit from the restored shards; in one process it is the safetensors format.
        """
        path = self.out / CHECKPOINT_DIR
        step, extra = load_run_checkpoint(
            path, self.model, self.optimizer, sharded=self.dist.enabled
        )
        if extra.get("job", "run") != "run":
            raise CheckpointError(
                f"{path} holds a `birkhoff {extra['job']}` run; `birkhoff run` resumes only its own"
            )
        if extra.get("preset") != self.preset.name:
            raise ValueError(f"checkpoint preset {extra.get('preset')!r} != {self.preset.name!r}")
        self.step = self.checkpoint_step = step
        self.skips.restore(extra)
        if self.dist.enabled:
            self.refit()
        else:
            self.engine = self.build_engine()
        self.engine.weight_version = int(extra["engine_version"])
        if self.dist.is_main:
            self.log.truncate_after(self.step)
        if (self.out / REFERENCE_DIR).is_dir() and self.rl.loss.kl_weight > 0:
            reference = Transformer(self.preset.model).to(self.device)
            apply_kernels(reference, resolve_kernels(self.preset.model, self.preset.train.kernels))
            load_checkpoint(self.out / REFERENCE_DIR, model=reference)
            self.reference = reference.eval().requires_grad_(False)

    # ------------------------------------------------------------------ the loop

    def run(
        self, *, stop_after: int | None = None, progress: bool = True, stop: StopFlag | None = None
    ) -> list[dict[str, Any]]:
        """Run (or continue) to the last step; return the rows written.

        The run ends early, with a checkpoint of the steps done, after global step `stop_after`
        or at the first step boundary after `stop` was raised (a signal: runtime.stop);
        `stopped_by` then says which. The engine is refit at the end of the warm-up and after
        every GRPO step, so each eval sees the trainer's current weights.
        """
        rows: list[dict[str, Any]] = []
        self.stopped_by = None
        with Progress(
            total=self.total_steps,
            initial=self.step,
            desc=self.preset.name,
            enabled=progress and self.dist.is_main,
        ) as bar:
            steps = self.step_rows()
            rows += self.baseline_eval()
            while self.step < self.total_steps:
                self.stopped_by = self.stop_reason(stop, stop_after)
                if self.stopped_by is not None:
                    if self.checkpoint_step != self.step:
                        self.save()
                    break
                rows += self.finish_step(next(steps), bar)
        return rows

    def baseline_eval(self) -> list[dict[str, Any]]:
        """Without a warm-up, the starting policy's held-out reward at step 0 (a fresh run
        only: a resumed one logged it before its checkpoint), so every run's curve starts from
        the policy GRPO starts from."""
        if self.rl.warmup_steps > 0 or self.step > 0 or self.checkpoint_step is not None:
            return []
        row = {"phase": "eval", "step": 0, **self.evaluate_generated()}
        if self.dist.is_main:
            self.log.append(row)
        return [row]

    def stop_reason(self, stop: StopFlag | None, stop_after: int | None) -> str | None:
        """Why the run stops before its next step, or None; every rank gives the same answer."""
        return stop_reason(
            stop, stop_after, step=self.step, distributed=self.dist.enabled, device=self.device
        )

    def finish_step(self, row: dict[str, Any], bar: Progress) -> list[dict[str, Any]]:
        """After a step: refit at the end of the warm-up, evaluate, log, checkpoint."""
        self.step += 1
        rows = [row]
        grpo_done = self.step - self.rl.warmup_steps
        if grpo_done == 0:
            self.refit()  # serve the warmed-up policy
        if grpo_done == 0 or (
            grpo_done > 0 and (grpo_done % self.rl.eval_every == 0 or self.step == self.total_steps)
        ):
            rows.append({"phase": "eval", "step": self.step, **self.evaluate_generated()})
        self.skips.count(row)
        for r in rows:
            if self.dist.is_main:
                self.log.append(r)
        bar.update(self.log.postfix())
        self.skips.check(
            row["step"], checkpoint=self.out / CHECKPOINT_DIR, checkpoint_step=self.checkpoint_step
        )
        if self.should_checkpoint():
            self.save()
        return rows

    def should_checkpoint(self) -> bool:
        """At the end, at the end of the warm-up, and every `checkpoint_every` steps of each
        phase (counted from the phase's start)."""
        every = self.rl.checkpoint_every
        grpo_done = self.step - self.rl.warmup_steps
        in_phase = self.step if grpo_done < 0 else grpo_done
        return (
            self.step == self.total_steps
            or grpo_done == 0
            or (every > 0 and in_phase > 0 and in_phase % every == 0)
        )
