"""Verifiable tasks generated in code, their rewards, and supervised batches.

Legend: B batch, T tokens.

A task samples `Problem(prompt, answer)` pairs from a seeded `random.Random` and scores a
completion with a verifiable reward:
    reward = 1.0 if completion == answer else 0.0
where `completion` is the text the model produced before its EOS (`CharTokenizer.decode` stops
at the first EOS). Exact match only: no partial credit, no whitespace stripping, so the reward
cannot be gamed by padding an answer.

Sequence layout (shared by supervised warm-up, generation and RL):
    [bos] prompt answer [eos] [pad ...]
`build_supervised_batch` right-pads to [B,T] and sets `loss_mask` on the answer tokens and the
EOS only. The mask is aligned with the *target positions* of `labels` = input ids, the convention
of birkhoff/model/mtp.py: mask[j] says whether token j is something to learn, and the model shifts
labels and mask together (position i predicts token i+1 on the main head, i+k+1 at MTP depth k).

Design choices: operands of `AdditionTask` have 1..num_digits digits (uniform value in
[0, 10^num_digits)), the answer is written most-significant digit first, as people write it.
`SortingTask` sorts characters by code point (digits before letters). Left out: chain-of-thought
formats, reversed answers, tasks needing text outside the tokenizer's vocabulary.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from birkhoff.tokenizer import CharTokenizer


class Problem(NamedTuple):
    prompt: str
    answer: str


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Problem: ...

    def reward(self, problem: Problem, completion: str) -> float: ...

    def max_length(self) -> int: ...


def exact_match_reward(problem: Problem, completion: str) -> float:
    """1.0 iff the completion (text before EOS) equals the answer exactly, else 0.0."""
    return 1.0 if completion == problem.answer else 0.0


class AdditionTask:
    """'a+b=' -> str(a+b), with a, b uniform in [0, 10^num_digits)."""

    name = "addition"

    def __init__(self, num_digits: int = 3) -> None:
        if not isinstance(num_digits, int) or not 1 <= num_digits <= 18:
            raise ValueError(f"num_digits={num_digits!r} is invalid: must be an int in [1, 18]")
        self.num_digits = num_digits

    def sample(self, rng: random.Random) -> Problem:
        high = 10**self.num_digits
        a, b = rng.randrange(high), rng.randrange(high)
        return Problem(f"{a}+{b}=", str(a + b))

    def reward(self, problem: Problem, completion: str) -> float:
        return exact_match_reward(problem, completion)

    def max_length(self) -> int:
        """Longest prompt + answer in characters."""
        return (2 * self.num_digits + 2) + (self.num_digits + 1)


class SortingTask:
    """'sort:dbca=' -> 'abcd': sort `length` characters drawn from `alphabet` (repeats allowed)."""

    name = "sorting"

    def __init__(self, length: int = 6, alphabet: str = "abcdefghijklmnopqrstuvwxyz") -> None:
        if not isinstance(length, int) or not 1 <= length <= 64:
            raise ValueError(f"length={length!r} is invalid: must be an int in [1, 64]")
        if len(alphabet) < 2 or len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet={alphabet!r} is invalid: needs >= 2 distinct characters")
        self.length, self.alphabet = length, alphabet

    def sample(self, rng: random.Random) -> Problem:
        chars = "".join(rng.choice(self.alphabet) for _ in range(self.length))
        return Problem(f"sort:{chars}=", "".join(sorted(chars)))

    def reward(self, problem: Problem, completion: str) -> float:
        return exact_match_reward(problem, completion)

    def max_length(self) -> int:
        """Longest prompt + answer in characters."""
        return len("sort:=") + 2 * self.length


TASKS: dict[str, Callable[..., Task]] = {"addition": AdditionTask, "sorting": SortingTask}


def get_task(name: str, **kwargs: object) -> Task:
    """A task by registry name; unknown names raise ValueError listing the valid ones."""
    factory = TASKS.get(name)
    if factory is None:
        raise ValueError(f"task={name!r} is unknown; valid tasks: {sorted(TASKS)}")
    return factory(**kwargs)


def sample_problems(task: Task, rng: random.Random, num_problems: int) -> list[Problem]:
    return [task.sample(rng) for _ in range(num_problems)]


def prompt_ids(problem: Problem, tokenizer: CharTokenizer) -> list[int]:
    """[bos] + prompt: what a generator is conditioned on."""
    return [tokenizer.bos_id, *tokenizer.encode(problem.prompt)]


class SupervisedBatch(NamedTuple):
    input_ids: Tensor  # [B,T] int64, right-padded with pad_id; also the labels
    loss_mask: Tensor  # [B,T] bool, True on answer tokens and EOS (target positions)

    def to(self, device: torch.device | str) -> SupervisedBatch:
        return SupervisedBatch(self.input_ids.to(device), self.loss_mask.to(device))


def build_supervised_batch(
    problems: Sequence[Problem], tokenizer: CharTokenizer, *, seq_len: int | None = None
) -> SupervisedBatch:
    """Token ids of [bos] prompt answer [eos], right-padded to [B,T], and the answer loss mask.

    `seq_len` fixes T (ValueError if a sequence is longer); None pads to the longest sequence.
    """
    if not problems:
        raise ValueError("problems is empty: need at least one problem for a batch")
    rows, masks = [], []
    for problem in problems:
        prompt = prompt_ids(problem, tokenizer)
        answer = [*tokenizer.encode(problem.answer), tokenizer.eos_id]
        rows.append(prompt + answer)
        masks.append([False] * len(prompt) + [True] * len(answer))
    T = max(len(r) for r in rows) if seq_len is None else seq_len
    if max(len(r) for r in rows) > T:
        raise ValueError(f"seq_len={seq_len} is too short for a sequence of {max(map(len, rows))}")
    ids_BT = torch.full((len(rows), T), tokenizer.pad_id, dtype=torch.int64)
    mask_BT = torch.zeros((len(rows), T), dtype=torch.bool)
    for b, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        ids_BT[b, : len(row)] = torch.tensor(row)
        mask_BT[b, : len(mask)] = torch.tensor(mask)
    return SupervisedBatch(ids_BT, mask_BT)
