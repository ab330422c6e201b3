"""Training: config, optimizer and schedule, recompute policy, the step, the supervised loop,
metrics and progress, atomic checkpoints."""

from birkhoff.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from birkhoff.train.config import TrainConfig
from birkhoff.train.optim import build_optimizer, lr_at
from birkhoff.train.step import forward_context, supervised_loss, train_step

__all__ = [
    "CheckpointError",
    "TrainConfig",
    "build_optimizer",
    "forward_context",
    "load_checkpoint",
    "lr_at",
    "save_checkpoint",
    "supervised_loss",
    "train_step",
]
