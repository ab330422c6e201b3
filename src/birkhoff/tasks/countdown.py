"""Countdown: reach a target from given numbers with + - * / (the task TinyZero trained with GRPO).

Rule (TinyZero's `validate_equation`): every given number is used exactly once, no other number
appears (`use_all=False`: each at most once). The evaluator never runs model text: a whitelist
tokenizer, a recursive-descent parser over `fractions.Fraction`, bounded length, depth and
digits; anything malformed raises `ExpressionError`, which scores 0. Generation builds a random
expression tree over all the numbers, so every instance is solvable and its reference answer is
that expression; the verifier reads numbers and target back from it. Details: docs/tasks.md.
Left out: unary minus, exponents, decimals and "=" in answers.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction
from typing import NamedTuple

from birkhoff.tasks.answers import CLOSE, OPEN, extract_answer, format_reward
from birkhoff.tasks.problems import Problem

MAX_CHARS = 256
MAX_DEPTH = 32
MAX_DIGITS = 6
TOKEN = re.compile(r"\s*(\d+|[-+*/()])")
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
ATOM = 3


class ExpressionError(ValueError):
    """Text that is not a valid Countdown expression (why, in the message)."""


def tokenize(text: str) -> list[str]:
    """Numbers, operators and parentheses of `text`; anything else raises ExpressionError."""
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"expression longer than {MAX_CHARS} characters")
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].isspace():
            break
        match = TOKEN.match(text, pos)
        if match is None:
            raise ExpressionError(f"unexpected character {text[pos:].lstrip()[:1]!r}")
        token = match.group(1)
        if token.isdigit() and len(token) > MAX_DIGITS:
            raise ExpressionError(f"number {token[:10]}... has more than {MAX_DIGITS} digits")
        if token.isdigit() and len(token) > 1 and token[0] == "0":
            raise ExpressionError(f"number {token!r} has a leading zero")
        tokens.append(token)
        pos = match.end()
    return tokens


class Parser:
    """expr := term (('+'|'-') term)*; term := atom (('*'|'/') atom)*; atom := NUMBER | (expr)"""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos = tokens, 0
        self.numbers: list[int] = []  # the literals, in order

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ExpressionError("expression ends early")
        self.pos += 1
        return token

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op, right = self.take(), self.term(depth)
            value = value + right if op == "+" else value - right
        return value

    def term(self, depth: int) -> Fraction:
        value = self.atom(depth)
        while self.peek() in ("*", "/"):
            op, right = self.take(), self.atom(depth)
            if op == "/" and right == 0:
                raise ExpressionError("division by zero")
            value = value * right if op == "*" else value / right
        return value

    def atom(self, depth: int) -> Fraction:
        token = self.take()
        if token == "(":
            if depth >= MAX_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ExpressionError("unbalanced parentheses")
            return value
        if not token.isdigit():
            raise ExpressionError(f"expected a number or '(', got {token!r}")
        self.numbers.append(int(token))
        return Fraction(int(token))


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """(exact value, numbers used in order) of a Countdown expression; ExpressionError else."""
    parser = Parser(tokenize(text))
    if not parser.tokens:
        raise ExpressionError("empty expression")
    value = parser.expr(0)
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after a complete expression")
    return value, parser.numbers


def uses_numbers(used: list[int], given: list[int], *, use_all: bool) -> bool:
    """Whether `used` is the multiset `given` (use_all) or a sub-multiset of it."""
    remaining = list(given)
    for n in used:
        if n not in remaining:
            return False
        remaining.remove(n)
    return not remaining or not use_all


def is_solution(text: str, numbers: list[int], target: int, *, use_all: bool = True) -> bool:
    """Whether `text` is an expression of `numbers` (the rule above) whose value is `target`."""
    try:
        value, used = evaluate(text)
    except ExpressionError:
        return False
    return value == target and uses_numbers(used, numbers, use_all=use_all)


Item = tuple[int, str, int]  # a subtree while generating: value, text, precedence


class Instance(NamedTuple):
    numbers: list[int]
    target: int
    solution: str


def combine(rng: random.Random, items: list[Item], ops: str) -> list[Item] | None:
    """Two random items combined by a random operator (the rest kept), or None when that
    operator does not fit them (a negative or inexact result)."""
    i, j = rng.sample(range(len(items)), 2)
    (a, text_a, prec_a), (b, text_b, prec_b), op = items[i], items[j], rng.choice(ops)
    if (op == "-" and a < b) or (op == "/" and (b == 0 or a % b)):
        return None
    value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
    prec = PRECEDENCE[op]
    left = f"({text_a})" if prec_a < prec else text_a
    right = f"({text_b})" if prec_b < prec or (prec_b == prec and op in "-/") else text_b
    rest = [item for k, item in enumerate(items) if k not in (i, j)]
    return [*rest, (value, f"{left}{op}{right}", prec)]


MAX_TRIES = 100_000


def generate(
    rng: random.Random, *, num_numbers: int, max_number: int, max_target: int, ops: str
) -> Instance:
    """A solvable instance: random numbers in [1, max_number], a random expression tree over
    all of them whose value is an integer in [1, max_target]."""
    for _ in range(MAX_TRIES):
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        items: list[Item] | None = [(n, str(n), ATOM) for n in numbers]
        while items is not None and len(items) > 1:
            items = combine(rng, items, ops)
        if items is not None and 1 <= items[0][0] <= max_target:
            rng.shuffle(numbers)  # the prompt's order says nothing about the solution's
            return Instance(numbers, items[0][0], items[0][1])
    raise ValueError(
        f"no instance with target <= {max_target} in {MAX_TRIES} tries: "
        f"num_numbers={num_numbers}, max_number={max_number}, ops={ops!r}"
    )


def reference(answer: str) -> tuple[list[int], int]:
    """(numbers, target) of a reference answer: an expression, bare or in answer tags."""
    expression = extract_answer(answer, fallback="text") or ""
    value, numbers = evaluate(expression)
    if value.denominator != 1:
        raise ExpressionError(f"reference {expression!r} has the non-integer value {value}")
    return numbers, int(value)


def countdown_reward(problem: Problem, completion: str, *, use_all: bool = True) -> float:
    """1.0 iff the completion's answer (answers.extract_answer, else the whole text) solves the
    instance of `problem.answer`'s reference expression."""
    numbers, target = reference(problem.answer)
    candidate = extract_answer(completion, fallback="text")
    ok = candidate is not None and is_solution(candidate, numbers, target, use_all=use_all)
    return 1.0 if ok else 0.0


class CountdownTask:
    """Countdown instances as chat prompts (answer in tags) or compact ones (tiny tokenizer).

    style "chat": TinyZero's instruction, the answer in <answer></answer>, stop at "</answer>";
    style "compact": "countdown 3,7,25 to 81:" -> "(7+3)*25-..." in the character vocabulary
    (lowercase, no "/": its ops default to "+-*"). `format_weight` > 0 gives a formatted wrong
    answer that reward instead of 0 (TinyZero: 0.1); correctness alone by default.
    """

    name = "countdown"

    def __init__(
        self,
        *,
        num_numbers: int = 4,
        max_number: int = 100,
        max_target: int = 100,
        ops: str | None = None,
        style: str = "chat",
        use_all: bool = True,
        format_weight: float = 0.0,
    ) -> None:
        check_style(style)
        ops = ops if ops is not None else ("+-*/" if style == "chat" else "+-*")
        if not 2 <= num_numbers <= 6:
            raise ValueError(f"num_numbers={num_numbers!r} is invalid: must be in [2, 6]")
        if not 1 <= max_number < 10**MAX_DIGITS or max_target < 1:
            raise ValueError(f"max_number={max_number}, max_target={max_target}: must be >= 1")
        if not ops or set(ops) - set("+-*/"):
            raise ValueError(f"ops={ops!r} is invalid: a non-empty subset of '+-*/'")
        if not 0 <= format_weight < 1:
            raise ValueError(f"format_weight={format_weight!r} is invalid: must be in [0, 1)")
        self.num_numbers, self.max_number, self.max_target = num_numbers, max_number, max_target
        self.ops, self.style, self.use_all, self.format_weight = ops, style, use_all, format_weight
        self.stop: tuple[str, ...] = (CLOSE,) if style == "chat" else ()

    def sample(self, rng: random.Random) -> Problem:
        inst = generate(
            rng,
            num_numbers=self.num_numbers,
            max_number=self.max_number,
            max_target=self.max_target,
            ops=self.ops,
        )
        if self.style == "compact":
            return Problem(
                f"countdown {','.join(map(str, inst.numbers))} to {inst.target}:", inst.solution
            )
        rule = "exactly once" if self.use_all else "at most once"
        ops = ", ".join(self.ops)
        prompt = (
            f"Using the numbers {inst.numbers}, create an equation that equals {inst.target}. "
            f"You can use the operations {ops} and parentheses, and each number {rule}. "
            f"Show your work, then give the final equation in {OPEN} {CLOSE} tags, "
            f"for example {OPEN}(1 + 2) * 3{CLOSE}."
        )
        return Problem(prompt, f"{OPEN}{inst.solution}{CLOSE}")

    def reward(self, problem: Problem, completion: str) -> float:
        if countdown_reward(problem, completion, use_all=self.use_all):
            return 1.0
        return self.format_weight * format_reward(completion) if self.format_weight else 0.0

    def max_length(self) -> int:
        """Longest prompt + answer in characters (a bound)."""
        digits = len(str(max(self.max_number, self.max_target)))
        numbers = self.num_numbers * (digits + 2)
        solution = self.num_numbers * (digits + 3)
        return 300 + numbers + 2 * solution if self.style == "chat" else 16 + numbers + solution


STYLES = ("chat", "compact")


def check_style(style: str) -> None:
    if style not in STYLES:
        raise ValueError(f"style={style!r} is invalid: one of {STYLES}")
