"""Named presets: functions returning whole run configs (model + training + task).

Design choices: a preset is plain data (`Preset`, frozen) built by a function, so it reads as
the full recipe in one place and the CLI only applies a few overrides (steps, seed). The
tokenizer is fixed in code, so every preset's vocab_size is the tokenizer's. `rl` is reserved
for the RL loop's config (None = supervised training only).

- `tiny_cpu`: trains on 2 CPU cores in under 2 minutes and learns 2-digit addition visibly
  (main loss ~3.9 -> ~0.5, greedy exact match from 0 to a sizeable fraction). Tiny matrices
  gain nothing from intra-op threads and suffer badly when cores are shared, so it runs on one.
- `h200_small`: ~120M parameters (dim 768, 16 layers, S=4, M=1), seq 2048, bf16 autocast; the
  benchmark model for one H200.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from birkhoff.config import ModelConfig
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train.config import TrainConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    name: str
    model: ModelConfig
    train: TrainConfig
    task: str = "addition"
    task_options: dict[str, Any] = field(default_factory=dict)
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    rl: Any = None  # the RL loop's config; None for supervised-only presets

    def replace(self, **changes: Any) -> Preset:
        return dataclasses.replace(self, **changes)


def tiny_cpu() -> Preset:
    model = ModelConfig(
        vocab_size=CharTokenizer().vocab_size,
        dim=64,
        num_layers=2,
        num_heads=4,
        num_streams=4,
        mtp_depth=1,
        max_seq_len=64,
    )
    train = TrainConfig(lr=3e-3, warmup_steps=50, num_steps=800, batch_size=64, log_every=10)
    return Preset(
        name="tiny-cpu",
        model=model,
        train=train,
        task="addition",
        task_options={"num_digits": 2},
        num_threads=1,
    )


def h200_small() -> Preset:
    model = ModelConfig(
        vocab_size=CharTokenizer().vocab_size,
        dim=768,
        num_layers=16,
        num_heads=12,
        num_streams=4,
        mtp_depth=1,
        max_seq_len=2048,
    )
    train = TrainConfig(
        lr=6e-4, warmup_steps=200, num_steps=5000, batch_size=8, amp_dtype="bf16", log_every=10
    )
    return Preset(
        name="h200-small", model=model, train=train, task="addition", task_options={"num_digits": 8}
    )


PRESETS: dict[str, Callable[[], Preset]] = {"tiny-cpu": tiny_cpu, "h200-small": h200_small}


def get_preset(name: str) -> Preset:
    """The preset called `name`; unknown names raise ValueError listing the valid ones."""
    factory = PRESETS.get(name)
    if factory is None:
        raise ValueError(f"preset={name!r} is unknown; valid presets: {sorted(PRESETS)}")
    return factory()
