"""TrainConfig: the optimisation hyper-parameters of a training run.

Frozen, slotted, keyword-only; invalid values raise ValueError naming the field and the value.
Defaults are a reasonable small-model AdamW setup (betas 0.9/0.95, wd 0.1, clip 1.0), not a
recipe for any particular scale; presets.py sets them per run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from birkhoff.config import KERNELS, Kernels, check

AmpDtype = Literal["none", "bf16"]
RecomputeMode = Literal["none", "full"]
ReclaimMode = Literal["safe", "always", "never"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """AdamW + warmup/cosine schedule + clipping + bf16 autocast (CUDA only) + recompute policy."""

    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at num_steps
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping (norm still reported)
    warmup_steps: int = 100
    num_steps: int = 1000
    batch_size: int = 32
    seed: int = 0
    amp_dtype: AmpDtype = "none"
    log_every: int = 10
    # `birkhoff train` writes a checkpoint every this many steps (0: only at the end and when
    # stopped); `birkhoff run`'s warm-up uses rl.checkpoint_every
    checkpoint_every: int = 100
    recompute: RecomputeMode = "none"  # "full": every block and MTP depth (apply_recompute)
    reclaim: ReclaimMode = "safe"  # what a recomputed unit does with its inputs' storage
    compile: bool = False  # torch.compile blocks, MTP depths, heads (train/recompute.py)
    cuda_graph: bool = False  # supervised steps replay forward + backward from CUDA graphs
    max_skipped_in_row: int = 5  # this many non-finite steps in a row stop the run
    # fused Triton ops for the mHC modules ("auto": on CUDA) and, in the RL loop, the engine's
    kernels: Kernels = "auto"
    # mHC mixes folded into the projections around each sublayer where the fused ops run
    # (model/fold.py; numerics differ from the unfused path by a bf16 rounding, hence opt-in)
    fold_gemms: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "eps"):
            value = getattr(self, name)
            check(math.isfinite(value) and value > 0, name, value, "must be finite and > 0")
        for name in ("weight_decay", "grad_clip"):
            value = getattr(self, name)
            check(math.isfinite(value) and value >= 0, name, value, "must be finite and >= 0")
        r = self.min_lr_ratio
        check(0 <= r <= 1, "min_lr_ratio", r, "must be in [0, 1]")
        b = self.betas
        check(
            len(b) == 2 and all(0 <= x < 1 for x in b), "betas", b, "must be two values in [0, 1)"
        )
        check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        for name in ("num_steps", "batch_size", "log_every", "max_skipped_in_row"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "must be an int >= 1")
        ce = self.checkpoint_every
        check(isinstance(ce, int) and ce >= 0, "checkpoint_every", ce, "must be an int >= 0")
        check(isinstance(self.seed, int), "seed", self.seed, "must be an int")
        check(self.amp_dtype in ("none", "bf16"), "amp_dtype", self.amp_dtype, "none | bf16")
        check(self.recompute in ("none", "full"), "recompute", self.recompute, "none | full")
        check(isinstance(self.compile, bool), "compile", self.compile, "must be a bool")
        check(isinstance(self.fold_gemms, bool), "fold_gemms", self.fold_gemms, "must be a bool")
        check(
            not (self.compile and self.recompute == "full"),
            "compile",
            self.compile,
            "compiling recomputed blocks is not supported: use recompute='none'",
        )
        check(isinstance(self.cuda_graph, bool), "cuda_graph", self.cuda_graph, "must be a bool")
        check(
            not (self.cuda_graph and self.recompute == "full"),
            "cuda_graph",
            self.cuda_graph,
            "a CUDA graph replays no reclaim: use recompute='none'",
        )
        rc = self.reclaim
        check(rc in ("safe", "always", "never"), "reclaim", rc, "safe | always | never")
        check(self.kernels in KERNELS, "kernels", self.kernels, " | ".join(KERNELS))

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)
