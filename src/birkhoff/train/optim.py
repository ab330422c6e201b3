"""AdamW with a decay / no-decay split, and the learning-rate schedule as a pure function.

Weight decay applies to the `weight` of every `nn.Linear` and `nn.Embedding` only: never to
RMSNorm gains, biases or the mHC coefficients (`phi`, `alpha`, the static bias that encodes the
near-identity residual). The split is by module type, not by name, so a new module's linears are
decayed without touching this file; a tied embedding/lm_head weight is listed once. The
schedule is linear warm-up then cosine to `lr * min_lr_ratio`, a function of the step only, so a
resumed run gets the same learning rates. On CUDA the fused AdamW kernel is used. Why these
choices: docs/training.md.
Left out: Muon/other optimizers, per-layer learning rates, ZeRO sharding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from birkhoff.train.config import TrainConfig


def split_decay_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decay, no_decay): Linear/Embedding weights vs everything else, each parameter once."""
    decay_ids = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, nn.Linear | nn.Embedding)
    }
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for param in model.parameters():  # parameters() already skips shared duplicates
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if id(param) in decay_ids else no_decay).append(param)
    return decay, no_decay


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over two groups (decay / no decay); the lr is set per step by `set_lr`."""
    decay, no_decay = split_decay_params(model)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = any(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        fused=True if on_cuda else None,
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of (0-based) `step`: linear warmup, then cosine to lr * min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(cfg.num_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
