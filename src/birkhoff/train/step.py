"""One optimisation step: forward (in the right context), loss, backward, clip, AdamW step.

Legend: B batch, T tokens.

`forward_context(model, cfg)` is the single place that decides what wraps the forward (bf16
autocast on CUDA, `track_saved_storages()` under full recompute). The loss is pluggable,
`loss_fn(model, batch) -> (loss, metrics)`, with metrics read to floats once after backward; the
lr is a pure function of the step. MoE router biases move after an applied step. A step whose
loss or gradient norm is not finite is skipped and reported (`SkipCounter` stops a run after
`max_skipped_in_row`). Under FSDP2 each rank's loss is its share of the global token mean.
Design choices in detail: docs/training.md.
Left out: gradient accumulation, loss scaling (bf16 needs none).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from birkhoff.config import ModelConfig
from birkhoff.model.moe import load_metrics, moe_layers, update_router_bias
from birkhoff.model.mtp import combine_losses, shift_targets
from birkhoff.recompute import track_saved_storages
from birkhoff.runtime.distributed import global_share, global_sum, reduce_floats, world_size
from birkhoff.train.config import TrainConfig
from birkhoff.train.optim import lr_at, set_lr

Metrics = dict[str, float | Tensor]
LossFn = Callable[[nn.Module, Any], tuple[Tensor, Metrics]]
GraphedStep = Callable[[Any], tuple[Tensor, Metrics]]  # batch -> (loss, metrics), grads set


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextmanager
def forward_context(model: nn.Module, cfg: TrainConfig) -> Iterator[None]:
    """Autocast (bf16 on CUDA) and recompute tracking (cfg.recompute == "full") for a forward."""
    with ExitStack() as stack:
        if cfg.amp_dtype == "bf16":
            device = model_device(model)
            if device.type != "cuda":
                raise ValueError(f"amp_dtype='bf16' needs a CUDA model; the model is on {device}")
            stack.enter_context(torch.autocast(device_type="cuda", dtype=torch.bfloat16))
        if cfg.recompute == "full":
            stack.enter_context(track_saved_storages())
        yield


@torch.no_grad()
def answer_accuracy(argmax_BT: Tensor, labels_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """(token accuracy, sequence exact match) of the main head's argmax (`TransformerOutput.
    argmax`: the most likely token after position i) on masked targets.

    With teacher forcing, a sequence whose every masked target is the argmax is exactly what
    greedy decoding would produce, so the sequence figure equals greedy exact-match accuracy.
    """
    targets_BT, in_BT = shift_targets(labels_BT, mask_BT.bool(), 1)
    hit_BT = argmax_BT == targets_BT
    token_acc = (hit_BT & in_BT).sum() / in_BT.sum().clamp(min=1)
    has_target_B = in_BT.any(dim=1)
    all_hit_B = (hit_BT | ~in_BT).all(dim=1) & has_target_B
    seq_acc = all_hit_B.sum() / has_target_B.sum().clamp(min=1)
    return token_acc, seq_acc


def supervised_loss(model: nn.Module, batch: Any) -> tuple[Tensor, Metrics]:
    """L_main + lambda/M sum_k L_k on a SupervisedBatch (labels = input ids, answer mask).

    Over several ranks each term is this rank's share of the global token mean (global_share).
    """
    out = model(batch.input_ids, labels=batch.input_ids, loss_mask=batch.loss_mask)
    metrics: Metrics = {"main_loss": out.main_loss.detach()}
    for k, mtp_loss in enumerate(out.mtp_losses, start=1):
        metrics[f"mtp_loss_{k}"] = mtp_loss.detach()
    if out.mtp_losses:
        metrics["mtp_loss"] = torch.stack(out.mtp_losses).detach().mean()
    token_acc, seq_acc = answer_accuracy(out.argmax, batch.input_ids, batch.loss_mask)
    metrics["token_acc"], metrics["seq_acc"] = token_acc, seq_acc
    if world_size() == 1:
        return out.loss, metrics
    mask_BT, num_ranks = batch.loss_mask.bool(), world_size()
    main, *mtp = (
        global_share(loss, shift_targets(batch.input_ids, mask_BT, k + 1)[1].sum())
        for k, loss in enumerate([out.main_loss, *out.mtp_losses])
    )
    # shares times the world size: train_step's mean over ranks is then the global token mean
    metrics["main_loss"] = main.detach() * num_ranks
    for k, share in enumerate(mtp, start=1):
        metrics[f"mtp_loss_{k}"] = share.detach() * num_ranks
    if mtp:
        metrics["mtp_loss"] = torch.stack(mtp).detach().mean() * num_ranks
    cfg = model.cfg
    assert isinstance(cfg, ModelConfig), "the supervised loss needs a model carrying .cfg"
    return combine_losses(main, mtp, cfg.mtp_loss_weight), metrics


def sum_expert_load(model: nn.Module) -> None:
    """Data parallel: every rank's expert load summed into each MoE layer, so that every rank
    moves its router biases alike (a no-op in one process)."""
    if world_size() > 1:
        for _, layer in moe_layers(model):
            layer.expert_load.copy_(global_sum(layer.expert_load))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    cfg: TrainConfig,
    *,
    step: int,
    loss_fn: LossFn | None = None,
    graphs: GraphedStep | None = None,
) -> dict[str, float]:
    """Forward + loss + backward + clip + AdamW step at the lr of `step`; returns float metrics.

    Keys: loss, the loss_fn's metrics (default: main_loss, mtp_loss_k, mtp_loss, token_acc,
    seq_acc), grad_norm (before clipping), lr, skipped (1.0 if the step was not applied).
    `graphs` (a `train.graph.StepGraphs`, which holds its own loss) replays forward + loss +
    backward from a CUDA graph instead of running them.
    """
    if step < 0:
        raise ValueError(f"step={step} is invalid: must be >= 0")
    if graphs is not None and loss_fn is not None:
        raise ValueError("pass loss_fn or graphs, not both: the graphs were built with their loss")
    model.train()
    lr = lr_at(step, cfg)
    set_lr(optimizer, lr)
    optimizer.zero_grad(set_to_none=True)
    num_ranks = world_size()
    if graphs is not None:
        loss, metrics = graphs(batch)
    else:
        with forward_context(model, cfg):
            loss, metrics = (loss_fn or supervised_loss)(model, batch)
        (loss * num_ranks if num_ranks > 1 else loss).backward()  # FSDP2 averages over ranks
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor when the gradients are FSDP2 shards
        grad_norm = grad_norm.full_tensor()
    loss_sum = global_sum(loss.detach())  # every rank decides alike
    applied = bool(torch.isfinite(grad_norm) & torch.isfinite(loss_sum))
    sum_expert_load(model)
    load = load_metrics(model)  # before the bias moves: what this step's forward routed
    if applied:
        optimizer.step()
        update_router_bias(model)
    optimizer.zero_grad(set_to_none=True)
    floats = {name: float(value) for name, value in metrics.items()} | load
    result = {"loss": float(loss_sum)}
    result.update(reduce_floats(floats, "mean", loss.device))
    result.update(grad_norm=float(grad_norm), lr=lr, skipped=0.0 if applied else 1.0)
    return result


class NonFiniteError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm."""


class SkipCounter:
    """Counts skipped (non-finite) steps: the run's total goes into each metrics row
    (`skipped_total`); `max_in_row` of them in a row raise `NonFiniteError`."""

    def __init__(self, max_in_row: int) -> None:
        self.max_in_row, self.total, self.in_row = max_in_row, 0, 0

    def count(self, row: dict[str, Any]) -> None:
        """Count the skipped updates of `row` (a train row) and record the total in it."""
        skipped = int(row.get("skipped", 0.0))
        self.total += skipped
        self.in_row = self.in_row + 1 if skipped else 0
        row["skipped_total"] = float(self.total)

    def check(self, step: int, *, checkpoint: Path, checkpoint_step: int | None) -> None:
        """Raise `NonFiniteError` after too many in a row, pointing at the last checkpoint."""
        if self.in_row < self.max_in_row:
            return
        first = step - self.in_row + 1
        where = (
            "none written yet"
            if checkpoint_step is None
            else (f"{checkpoint} (step {checkpoint_step}; --resume continues from it)")
        )
        raise NonFiniteError(
            f"steps {first}-{step}: {self.in_row} steps in a row had a non-finite loss or "
            f"gradient norm and were skipped (max_skipped_in_row={self.max_in_row}; the "
            f"weights are those of step {first}); last good checkpoint: {where}"
        )

    def state(self) -> dict[str, int]:
        """What a checkpoint keeps of the counts (`restore` takes it back)."""
        return {"skipped_total": self.total, "skipped_in_row": self.in_row}

    def restore(self, state: dict[str, Any]) -> None:
        self.total = int(state.get("skipped_total", 0))
        self.in_row = int(state.get("skipped_in_row", 0))
