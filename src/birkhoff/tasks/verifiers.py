"""Named verifiers: reward functions that score a completion against a reference answer.

A verifier is built from a spec string (`get_verifier`): "exact" (normalised exact match),
"numeric" / "numeric:TOL" (the whole completion as a number, within tolerance), "answer" (the
answer read out of free text, answers.py), "countdown" (a Countdown expression of the
reference's numbers, countdown.py) or "module:function" (any fn(problem, completion) -> float |
bool, run guarded by guard.py). Each verifier also checks reference answers up front
(`check_answer`), so a data file with an answer it can never match fails at load time, with its
line number. Normalisation and matching rules in detail: docs/tasks.md.
Left out: partial credit beyond what a user function returns, model-based judges.
"""

from __future__ import annotations

import importlib
import math
import re
import unicodedata
from collections.abc import Callable
from typing import Any, Protocol

from birkhoff.tasks import countdown
from birkhoff.tasks.answers import numeric_answer
from birkhoff.tasks.guard import GuardedVerifier
from birkhoff.tasks.problems import Problem

NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


class Verifier(Protocol):
    name: str

    def check_answer(self, answer: str) -> None: ...

    def __call__(self, problem: Problem, completion: str) -> float: ...


def normalise(text: str) -> str:
    """NFKC, casefold, collapse whitespace, strip, drop one trailing period."""
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return text[:-1].rstrip() if text.endswith(".") else text


def parse_number(text: str) -> float | None:
    """The number `text` is (whole string, "," thousands separators allowed), else None."""
    text = text.strip().replace(",", "")
    if NUMBER.fullmatch(text) is None:
        return None
    value = float(text)
    return value if math.isfinite(value) else None


class ExactMatch:
    name = "exact"

    def check_answer(self, answer: str) -> None:
        if not normalise(answer):
            raise ValueError("answer is empty after normalisation")

    def __call__(self, problem: Problem, completion: str) -> float:
        return 1.0 if normalise(completion) == normalise(problem.answer) else 0.0


class NumericMatch:
    def __init__(self, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> None:
        for field, value in (("rel_tol", rel_tol), ("abs_tol", abs_tol)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{field}={value!r} is invalid: must be finite and >= 0")
        self.rel_tol, self.abs_tol = rel_tol, abs_tol
        self.name = f"numeric(rel_tol={rel_tol}, abs_tol={abs_tol})"

    def check_answer(self, answer: str) -> None:
        if parse_number(answer) is None:
            raise ValueError(f"answer {answer!r} is not a finite number (numeric verifier)")

    def __call__(self, problem: Problem, completion: str) -> float:
        value, ref = parse_number(completion), parse_number(problem.answer)
        if value is None or ref is None:
            return 0.0
        return 1.0 if math.isclose(value, ref, rel_tol=self.rel_tol, abs_tol=self.abs_tol) else 0.0


class FreeTextAnswer:
    """The number read out of a free-text completion equals the reference's (exact)."""

    name = "answer"

    def check_answer(self, answer: str) -> None:
        if numeric_answer(answer) is None:
            raise ValueError(f"answer {answer!r} holds no number (answer verifier)")

    def __call__(self, problem: Problem, completion: str) -> float:
        value = numeric_answer(completion)
        return 1.0 if value is not None and value == numeric_answer(problem.answer) else 0.0


class CountdownAnswer:
    """The completion's expression solves the instance of the reference expression."""

    name = "countdown"

    def check_answer(self, answer: str) -> None:
        try:
            countdown.reference(answer)
        except countdown.ExpressionError as err:
            raise ValueError(f"answer {answer!r} is not a Countdown expression ({err})") from err

    def __call__(self, problem: Problem, completion: str) -> float:
        return countdown.countdown_reward(problem, completion)


class PythonVerifier:
    """A user function fn(problem, completion) -> bool | float, named "module:function"."""

    def __init__(self, spec: str, fn: Callable[[Problem, str], object]) -> None:
        self.name, self.fn = spec, fn

    def check_answer(self, answer: str) -> None:
        """User functions define their own answers; nothing to check up front."""

    def __call__(self, problem: Problem, completion: str) -> float:
        value = self.fn(problem, completion)
        if isinstance(value, bool):
            return float(value)
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(
                f"verifier {self.name} returned {value!r}: need a bool or finite number"
            )
        return float(value)


def load_function(spec: str) -> Callable[[Problem, str], object]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"verifier={spec!r}: cannot import module {module_name!r} ({err})"
        ) from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"verifier={spec!r}: {module_name} has no callable {attr!r}")
    return fn


VERIFIERS = ("exact", "numeric", "numeric:TOL", "answer", "countdown", "module:function")


def get_verifier(spec: str, **guard: Any) -> Verifier:
    """A verifier from its spec string; unknown specs raise ValueError listing the valid forms.
    A user function runs guarded (guard.py; `guard`: GuardedVerifier's timeout_s,
    max_failure_rate, min_calls)."""
    if spec == "exact":
        return ExactMatch()
    if spec == "numeric":
        return NumericMatch()
    if spec == "answer":
        return FreeTextAnswer()
    if spec == "countdown":
        return CountdownAnswer()
    if spec.startswith("numeric:"):
        try:
            tol = float(spec.removeprefix("numeric:"))
        except ValueError as err:
            raise ValueError(f"verifier={spec!r}: tolerance is not a number") from err
        return NumericMatch(rel_tol=0.0, abs_tol=tol)
    if re.fullmatch(r"[\w.]+:\w+", spec):
        return GuardedVerifier(PythonVerifier(spec, load_function(spec)), **guard)
    raise ValueError(f"verifier={spec!r} is unknown; valid: {list(VERIFIERS)}")
