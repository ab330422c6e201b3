"""Supervised data for the training loop: a fresh batch of task problems per step.

Design choice: the batch of step n is drawn from `random.Random(f"{seed}:{n}")`, a function of
(seed, step) only. A resumed run therefore sees exactly the batches an uninterrupted run would,
without saving any data-loader state, and two runs with the same seed see the same data.
Problems are generated, never stored: the task space is large enough that a small model
sees few repeats. Left out: held-out splits by construction (use a different seed to evaluate).
"""

from __future__ import annotations

import random

from birkhoff.rl.tasks import SupervisedBatch, Task, build_supervised_batch, sample_problems
from birkhoff.tokenizer import CharTokenizer


def step_rng(seed: int, step: int) -> random.Random:
    """The RNG of one step's batch; string seeds hash deterministically (sha512)."""
    return random.Random(f"{seed}:{step}")


def batch_for_step(
    task: Task,
    tokenizer: CharTokenizer,
    *,
    batch_size: int,
    seed: int,
    step: int,
    seq_len: int | None = None,
) -> SupervisedBatch:
    """The supervised batch of `step`: [B,T] ids and answer mask (see build_supervised_batch)."""
    problems = sample_problems(task, step_rng(seed, step), batch_size)
    return build_supervised_batch(problems, tokenizer, seq_len=seq_len)
