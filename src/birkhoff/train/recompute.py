"""Activation recompute (and per-block compile) applied to a plain model from outside, as
torchtitan applies them.

`apply_recompute(model, reclaim=...)` makes every block and every MTP depth (merge and block as
one unit) run under `birkhoff.recompute.checkpoint`, by replacing the unit's `forward` on the
instance (parameter names, state_dict keys and the class stay the model's); the forward must then
run inside `track_saved_storages()`. `apply_checkpoint` takes any checkpoint function (benchmarks
put `torch.utils.checkpoint` on the same units). `compile_blocks` runs `torch.compile` on every
block, MTP depth and the heads' contraction and norm. Design choices: docs/training.md.
Left out: selective (per-op) recompute, recomputing only every n-th block, compile with
recompute.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from birkhoff.config import ModelConfig, resolve_kernels
from birkhoff.model.block import apply_fold
from birkhoff.model.hyper import apply_kernels
from birkhoff.model.transformer import Transformer
from birkhoff.recompute import RECLAIM_MODES, checkpoint
from birkhoff.train.config import ReclaimMode, TrainConfig

CheckpointFn = Callable[..., Any]  # checkpoint_fn(fn, *args, name=...) -> what fn returns


def recompute_units(model: Transformer) -> list[tuple[str, nn.Module]]:
    """(name, module) of every unit recompute wraps: blocks, then MTP depths (state_dict names)."""
    blocks = [(f"layers.{i}", block) for i, block in enumerate(model.blocks)]
    return blocks + [(f"mtp.{k}", depth) for k, depth in enumerate(model.mtp_depths)]


def _checkpointed_forward(
    module: nn.Module, *args: Any, checkpoint_fn: CheckpointFn, name: str
) -> Any:
    forward = functools.partial(type(module).forward, module)  # the class's own forward
    return checkpoint_fn(forward, *args, name=name)


def apply_checkpoint(model: Transformer, checkpoint_fn: CheckpointFn) -> Transformer:
    """Run every recompute unit of `model` through `checkpoint_fn`; returns `model`."""
    for name, unit in recompute_units(model):
        if "forward" in vars(unit):
            raise ValueError(f"{name}: recompute is already applied to this model")
        run = functools.partial(_checkpointed_forward, checkpoint_fn=checkpoint_fn, name=name)
        unit.forward = types.MethodType(run, unit)  # type: ignore[method-assign]
    return model


def apply_recompute(model: Transformer, *, reclaim: ReclaimMode = "safe") -> Transformer:
    """Every unit under `birkhoff.recompute.checkpoint(..., reclaim=reclaim)`; returns `model`."""
    if reclaim not in RECLAIM_MODES:
        raise ValueError(f"reclaim={reclaim!r} is invalid: expected one of {RECLAIM_MODES}")
    return apply_checkpoint(model, functools.partial(checkpoint, reclaim=reclaim))


def compile_units(model: Transformer) -> list[nn.Module]:
    """What `compile_blocks` compiles: every block, every MTP depth (its merge and block as one
    region, as recompute wraps it), and each output head's contraction and final norm."""
    heads: list[nn.Module] = [model.contraction, model.norm]
    for depth in model.mtp_depths:
        heads += [depth.contraction, depth.norm]
    return [unit for _, unit in recompute_units(model)] + heads


def compile_blocks(model: Transformer, **compile_kwargs: Any) -> Transformer:
    """`torch.compile(**compile_kwargs)` every module of `compile_units`, in place; returns
    `model`."""
    for unit in compile_units(model):
        unit.compile(**compile_kwargs)
    return model


def build_model(model_cfg: ModelConfig, cfg: TrainConfig, *, device: torch.device) -> Transformer:
    """A freshly initialised model on `device`, its kernels, recompute and compile applied as
    `cfg` says."""
    model = Transformer(model_cfg).to(device)
    apply_fold(apply_kernels(model, resolve_kernels(model_cfg, cfg.kernels)), cfg.fold_gemms)
    if cfg.recompute == "full":
        apply_recompute(model, reclaim=cfg.reclaim)
    if cfg.compile:
        compile_blocks(model)
    return model
