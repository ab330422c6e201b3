"""RLConfig: what one GRPO run does per step (rollout shape, loss, refit, checkpoints).

Frozen, slotted, keyword-only; invalid values raise ValueError naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from birkhoff.config import check
from birkhoff.rl.loss import GRPOLossConfig

Warmup = Literal["supervised", "mtp-self-distill"]
WARMUPS = ("supervised", "mtp-self-distill")


@dataclass(frozen=True, kw_only=True, slots=True)
class RLConfig:
    warmup_steps: int = 200  # steps before GRPO, of the `warmup` kind
    # "supervised": the task's answers; "mtp-self-distill": the MTP depths on the model's own
    # greedy completions, the main model frozen (rl/mtp_warmup.py)
    warmup: Warmup = "supervised"
    num_steps: int = 20  # GRPO steps (rollout -> update(s) -> refit)
    num_prompts: int = 16  # Q prompts per step
    group_size: int = 8  # W completions per prompt
    updates_per_step: int = 1  # optimizer steps per rollout batch (> 1 makes ratios != 1)
    max_staleness: int = 1  # refuse completions more than this many updates behind the trainer
    max_new_tokens: int = 8
    temperature: float = 1.0  # rollout sampling; the GRPO ratio uses the same temperature
    num_speculative_tokens: int = 2  # MTP drafts per verify step during rollouts
    mtp_loss_weight: float = 0.1  # MTP loss during RL, keeps the drafter on-policy
    normalize_adv_std: bool = True
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    lr: float = 1e-4  # GRPO learning rate (constant)
    refit_bucket_bytes: int = 1 << 20
    refit_quantize: str | None = None  # None | "fp8"
    num_eval_prompts: int = 64  # greedy exact-match reward on a fixed held-out set
    eval_every: int = 5
    checkpoint_every: int = 5

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_new_tokens", "updates_per_step", "eval_every"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "must be an int >= 1")
        for name in (
            "warmup_steps",
            "num_steps",
            "max_staleness",
            "num_speculative_tokens",
            "num_eval_prompts",
            "checkpoint_every",
        ):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 0, name, value, "must be an int >= 0")
        check(self.group_size >= 2, "group_size", self.group_size, "must be >= 2 for GRPO")
        t = self.temperature
        check(math.isfinite(t) and t > 0, "temperature", t, "must be > 0 for RL sampling")
        w = self.mtp_loss_weight
        check(math.isfinite(w) and w >= 0, "mtp_loss_weight", w, "must be finite and >= 0")
        check(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "must be finite and > 0")
        check(self.refit_bucket_bytes >= 1, "refit_bucket_bytes", self.refit_bucket_bytes, ">= 1")
        q = self.refit_quantize
        check(q in (None, "fp8"), "refit_quantize", q, "None | 'fp8'")
        check(self.warmup in WARMUPS, "warmup", self.warmup, f"one of {WARMUPS}")

    def replace(self, **changes: Any) -> RLConfig:
        return dataclasses.replace(self, **changes)
