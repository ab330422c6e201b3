"""Verifiable tasks generated in code, their rewards, and the seed streams a run draws from.

A task samples `Problem(prompt, answer)` pairs from a seeded `random.Random` and scores a
completion with a verifiable reward. Addition and sorting use exact match on the text before the
EOS (no partial credit, no whitespace stripping); free-text tasks (countdown.py, arithmetic.py)
read the answer out of the text (answers.py) and name their stop strings. `TASKS` registers
them all. Every random choice of a run is a function of (seed, step), defined here once:
`step_rng`, `held_out_rng` and `sampling_seed`. Task details and the seed streams: docs/tasks.md.
Left out: reversed answers.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple, Protocol


class Problem(NamedTuple):
    prompt: str
    answer: str


class Task(Protocol):
    name: str
    stop: tuple[str, ...]  # stop strings of its completions (e.g. "</answer>"); () for none

    def sample(self, rng: random.Random) -> Problem: ...

    def reward(self, problem: Problem, completion: str) -> float: ...

    def max_length(self) -> int: ...


def exact_match_reward(problem: Problem, completion: str) -> float:
    """1.0 iff the completion (text before EOS) equals the answer exactly, else 0.0."""
    return 1.0 if completion == problem.answer else 0.0


class AdditionTask:
    """'a+b=' -> str(a+b), with a, b uniform in [0, 10^num_digits)."""

    name = "addition"
    stop: tuple[str, ...] = ()

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
    stop: tuple[str, ...] = ()

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


def countdown_task(**options: object) -> Task:
    from birkhoff.tasks.countdown import CountdownTask  # imports this module

    return CountdownTask(**options)  # type: ignore[arg-type]


def arithmetic_words_task(**options: object) -> Task:
    from birkhoff.tasks.arithmetic import ArithmeticWordsTask  # imports this module

    return ArithmeticWordsTask(**options)  # type: ignore[arg-type]


TASKS: dict[str, Callable[..., Task]] = {
    "addition": AdditionTask,
    "sorting": SortingTask,
    "countdown": countdown_task,
    "arithmetic-words": arithmetic_words_task,
}


def get_task(name: str, **kwargs: object) -> Task:
    """A task by registry name; unknown names and options raise ValueError naming them."""
    factory = TASKS.get(name)
    if factory is None:
        raise ValueError(f"task={name!r} is unknown; valid tasks: {sorted(TASKS)}")
    try:
        return factory(**kwargs)
    except TypeError as err:  # an option the task does not take
        raise ValueError(f"task={name!r}: bad options {sorted(kwargs)} ({err})") from err


FREE_TEXT_TASKS = ("countdown", "arithmetic-words")  # tasks with a "chat" / "compact" style


def task_for_tokenizer(
    name: str, *, chat: bool, **options: object
) -> tuple[Task, dict[str, object]]:
    """A registry task and its options, the prompt style chosen for the tokenizer: "chat" when
    prompts go through a chat template (`chat`), else "compact" (the character tokenizer's
    vocabulary). Tasks without styles take `options` as given."""
    if name in FREE_TEXT_TASKS and "style" not in options:
        options = {**options, "style": "chat" if chat else "compact"}
    return get_task(name, **options), options


def sample_problems(task: Task, rng: random.Random, num_problems: int) -> list[Problem]:
    return [task.sample(rng) for _ in range(num_problems)]


def step_rng(seed: int, step: int) -> random.Random:
    """The RNG of one step's problems; string seeds hash deterministically (sha512)."""
    return random.Random(f"{seed}:{step}")


def held_out_rng(seed: int) -> random.Random:
    """The RNG of a run's evaluation problems: a stream no training step draws from."""
    return random.Random(f"{seed}:eval")


SEEDS_PER_RUN = 1_000_003  # a prime above any step count: (seed, step) pairs never share a seed


def sampling_seed(seed: int, step: int) -> int:
    """The generation seed of `step` in the run seeded `seed`."""
    return seed * SEEDS_PER_RUN + step
