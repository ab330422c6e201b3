"""Shared services of the jobs that train: checkpoints (atomic safetensors, checkpoint.py; sharded
DCP, dcp.py), a run's checkpoint for stop and resume (resume.py) and the graceful stop (stop.py),
distributed set-up (distributed.py), the metrics log and plot (metrics.py) and the progress bar
(progress.py).

The package sits below train/, rl/, interop/ and cli/ and imports nothing above config and model
(the checkpoint io builds the model it loads), so a converter or a command reads a checkpoint
without pulling in the trainer.
"""

from birkhoff.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]
