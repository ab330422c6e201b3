"""Training: config, optimizer and schedule, the training step, data, atomic checkpoints."""

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
