"""Training: config, optimizer and schedule, recompute policy, the step, the supervised loop.

Checkpoints, distributed set-up, metrics and progress are shared services in birkhoff.runtime.
"""

from birkhoff.train.config import TrainConfig
from birkhoff.train.optim import build_optimizer, lr_at
from birkhoff.train.step import forward_context, supervised_loss, train_step

__all__ = [
    "TrainConfig",
    "build_optimizer",
    "forward_context",
    "lr_at",
    "supervised_loss",
    "train_step",
]
