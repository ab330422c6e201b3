"""Prompts and supervised batches of task problems: the sequence layout every phase shares.

Legend: B batch, T tokens.

Layout: `prompt answer [eos] [pad ...]`, where the prompt carries the special tokens of the
tokenizer's own convention (`encode_prompt`; nothing here adds a BOS). `build_supervised_batch`
right-pads to [B,T] and sets `loss_mask` on the answer tokens and the EOS, aligned with the
target positions of `labels` (the convention of model/mtp.py). The batch of step n is a function
of (seed, n) only, so a resumed run sees the batches an uninterrupted one would with no
data-loader state. Details: docs/tasks.md.
Left out: stored data sets (problems are generated; JSONL files are jsonl.py's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from birkhoff.tasks.problems import Problem, Task, sample_problems, step_rng
from birkhoff.tokenizer import Tokenizer


def prompt_ids(problem: Problem, tokenizer: Tokenizer) -> list[int]:
    """The prompt's ids as the tokenizer frames a prompt: what a generator is conditioned on."""
    return tokenizer.encode_prompt(problem.prompt)


class SupervisedBatch(NamedTuple):
    input_ids: Tensor  # [B,T] int64, right-padded with pad_id; also the labels
    loss_mask: Tensor  # [B,T] bool, True on answer tokens and EOS (target positions)

    def to(self, device: torch.device | str) -> SupervisedBatch:
        return SupervisedBatch(self.input_ids.to(device), self.loss_mask.to(device))

    def padded(self, length: int, pad_id: int) -> SupervisedBatch:
        """Right-padded to `length` tokens: pad ids, mask False. The padding is not a target and,
        under the causal mask, no earlier position attends to it, so losses do not change."""
        T = self.input_ids.shape[1]
        if length < T:
            raise ValueError(f"length={length} is shorter than the batch's {T} tokens")
        pad = (0, length - T)
        ids_BT = torch.nn.functional.pad(self.input_ids, pad, value=pad_id)
        return SupervisedBatch(ids_BT, torch.nn.functional.pad(self.loss_mask, pad, value=False))


def build_supervised_batch(problems: Sequence[Problem], tokenizer: Tokenizer) -> SupervisedBatch:
    """Token ids of prompt answer [eos], right-padded to the longest, and the answer mask."""
    if not problems:
        raise ValueError("problems is empty: need at least one problem for a batch")
    rows, masks = [], []
    for problem in problems:
        prompt = prompt_ids(problem, tokenizer)
        answer = [*tokenizer.encode(problem.answer), tokenizer.eos_id]
        rows.append(prompt + answer)
        masks.append([False] * len(prompt) + [True] * len(answer))
    T = max(len(r) for r in rows)
    ids_BT = torch.full((len(rows), T), tokenizer.pad_id, dtype=torch.int64)
    mask_BT = torch.zeros((len(rows), T), dtype=torch.bool)
    for b, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        ids_BT[b, : len(row)] = torch.tensor(row)
        mask_BT[b, : len(mask)] = torch.tensor(mask)
    return SupervisedBatch(ids_BT, mask_BT)


def batch_for_step(
    task: Task,
    tokenizer: Tokenizer,
    *,
    batch_size: int,
    seed: int,
    step: int,
) -> SupervisedBatch:
    """The supervised batch of `step`: [B,T] ids and answer mask (see build_supervised_batch)."""
    problems = sample_problems(task, step_rng(seed, step), batch_size)
    return build_supervised_batch(problems, tokenizer)
