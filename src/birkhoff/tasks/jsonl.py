"""Tasks from a JSONL file: one prompt and reference answer per line, scored by a named verifier.

Each non-blank line is a JSON object {"prompt": str, "answer": str | number, ...}; other keys
are ignored. `load_jsonl_tasks` reads and checks the whole file before returning, and every
problem is reported as `FILE:LINE: what is wrong` (invalid JSON, not an object, missing or
non-string prompt, empty prompt, answer the verifier can never match, text the tokenizer cannot
encode, a sequence longer than max_seq_len), so a bad file fails before any training starts.
The checks collect up to `MAX_ERRORS` problems so one run fixes many lines.

Held-out split: a separate eval file, or a seeded shuffle of the lines with `eval_fraction` of
them (at least one) held out. Both splits are `JsonlTask`s with the Task interface of
birkhoff/tasks/problems.py: `sample(rng)` draws uniformly from the split, `reward` is the verifier,
`max_length()` is the longest prompt + answer in characters; `problems` is the whole split (the
held-out evaluation can use all of it instead of sampling).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from birkhoff.tasks.problems import Problem
from birkhoff.tasks.verifiers import Verifier, get_verifier

MAX_ERRORS = 20


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...


class JsonlTask:
    """Problems of one split of a JSONL file, scored by a verifier."""

    stop: tuple[str, ...] = ()

    def __init__(self, name: str, problems: Sequence[Problem], verifier: Verifier) -> None:
        if not problems:
            raise ValueError(f"task {name!r} has no problems")
        self.name, self.problems, self.verifier = name, list(problems), verifier

    def sample(self, rng: random.Random) -> Problem:
        return self.problems[rng.randrange(len(self.problems))]

    def reward(self, problem: Problem, completion: str) -> float:
        return self.verifier(problem, completion)

    def max_length(self) -> int:
        """Longest prompt + answer in characters."""
        return max(len(p.prompt) + len(p.answer) for p in self.problems)

    def counts(self) -> dict[str, int]:
        """The guarded verifier's calls, errors and timeouts so far (guard.py); {} for others."""
        counts = getattr(self.verifier, "counts", None)
        return {} if counts is None else counts()


class JsonlSplits(NamedTuple):
    train: JsonlTask
    eval: JsonlTask


class DataError(ValueError):
    """A JSONL data file has malformed lines; the message lists them as FILE:LINE: reason."""


def parse_line(text: str) -> Problem:
    """One line as a Problem; ValueError says what is wrong."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"invalid JSON ({err.msg} at column {err.colno})") from err
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [key for key in ("prompt", "answer") if key not in record]
    if missing:
        raise ValueError(f"no {' and no '.join(repr(k) for k in missing)} key")
    prompt, answer = record["prompt"], record["answer"]
    if not isinstance(prompt, str):
        raise ValueError(f"'prompt' must be a string, got {prompt!r}")
    if not prompt.strip():
        raise ValueError("'prompt' is empty")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"'answer' must be a string or a number, got {answer!r}")
    return Problem(prompt, str(answer))


def read_problems(
    path: Path,
    verifier: Verifier,
    *,
    tokenizer: Encoder | None = None,
    max_seq_len: int | None = None,
) -> list[Problem]:
    """Every problem of a JSONL file, after checking each line (DataError lists the bad ones)."""
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    problems, errors = [], []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                problem = parse_line(text)
                verifier.check_answer(problem.answer)
                if tokenizer is not None:
                    check_encodable(problem, tokenizer, max_seq_len)
                problems.append(problem)
            except ValueError as err:
                errors.append(f"{path}:{number}: {err}")
    if errors:
        more = f"\n... and {len(errors) - MAX_ERRORS} more" if len(errors) > MAX_ERRORS else ""
        raise DataError("malformed data lines:\n" + "\n".join(errors[:MAX_ERRORS]) + more)
    if not problems:
        raise DataError(f"{path}: no problems (the file has no non-blank lines)")
    return problems


def check_encodable(problem: Problem, tokenizer: Encoder, max_seq_len: int | None) -> None:
    """Both texts encode, and prompt (as the tokenizer frames it) answer [eos] fits max_seq_len."""
    prompt = tokenizer.encode_prompt(problem.prompt)
    num_tokens = len(prompt) + len(tokenizer.encode(problem.answer)) + 1
    if max_seq_len is not None and num_tokens > max_seq_len:
        raise ValueError(
            f"{num_tokens} tokens (framed prompt, answer, eos) > max_seq_len={max_seq_len}"
        )


def split_problems(
    problems: list[Problem], *, eval_fraction: float, seed: int
) -> tuple[list[Problem], list[Problem]]:
    """(train, eval): a seeded shuffle, eval gets round(fraction * n) >= 1 problems."""
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction={eval_fraction!r} is invalid: must be in (0, 1)")
    if len(problems) < 2:
        raise DataError(f"{len(problems)} problem(s): a held-out split needs at least 2")
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    num_eval = min(max(1, round(eval_fraction * len(problems))), len(problems) - 1)
    held_out = set(order[:num_eval])
    train = [p for i, p in enumerate(problems) if i not in held_out]
    return train, [problems[i] for i in sorted(held_out)]


def load_jsonl_tasks(
    path: str | os.PathLike[str],
    *,
    verifier: str = "exact",
    eval_path: str | os.PathLike[str] | None = None,
    eval_fraction: float = 0.1,
    seed: int = 0,
    tokenizer: Encoder | None = None,
    max_seq_len: int | None = None,
    **guard: Any,
) -> JsonlSplits:
    """Train and held-out tasks from JSONL file(s), every line checked before returning.

    `tokenizer` / `max_seq_len`, when given, also check that every line encodes and fits;
    `guard` sets a user verifier's timeout and failure limits (guard.GuardedVerifier).
    """
    check = get_verifier(verifier, **guard)

    def read(file: str | os.PathLike[str]) -> list[Problem]:
        return read_problems(Path(file), check, tokenizer=tokenizer, max_seq_len=max_seq_len)

    problems = read(path)
    if eval_path is None:
        train, held_out = split_problems(problems, eval_fraction=eval_fraction, seed=seed)
    else:
        train, held_out = problems, read(eval_path)
    name = Path(path).stem
    return JsonlSplits(JsonlTask(name, train, check), JsonlTask(f"{name}-eval", held_out, check))
