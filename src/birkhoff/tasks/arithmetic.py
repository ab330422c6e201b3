"""Multi-digit arithmetic in words: "What is forty-seven plus one hundred and six?" -> 153.

Numbers are written in British English words up to 10^15 - 1; operators are "plus", "minus",
"times" and "divided by", evaluated with the usual precedence; division is always exact and
answers are integers. Difficulty levels "easy", "medium" and "hard" set the digits, terms and
operators (each may be overridden). Styles as in countdown.py: "chat" (answer in <answer></answer>
tags) or "compact" (in the character tokenizer's vocabulary). The reward reads the answer out of
free text (answers.numeric_answer) and compares it exactly. Details: docs/tasks.md.
Left out: non-integer answers, numbers of 10^15 and above.
"""

from __future__ import annotations

import random
from fractions import Fraction

from birkhoff.tasks.answers import CLOSE, OPEN, format_reward, numeric_answer
from birkhoff.tasks.countdown import check_style
from birkhoff.tasks.problems import Problem

# fmt: off
ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
        "nineteen")
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
# fmt: on
SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"))
OPERATORS = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}
LEVELS = {"easy": (2, 2, "+-"), "medium": (3, 2, "+-*/"), "hard": (4, 3, "+-*/")}


def below_hundred(n: int) -> str:
    if n < 20:
        return ONES[n]
    tens, ones = divmod(n, 10)
    return TENS[tens] + (f"-{ONES[ones]}" if ones else "")


def below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    if not hundreds:
        return below_hundred(rest)
    head = f"{ONES[hundreds]} hundred"
    return f"{head} and {below_hundred(rest)}" if rest else head


def number_words(n: int) -> str:
    """`n` (0 <= n < 10^15) in British English words: 106 -> "one hundred and six"."""
    if not 0 <= n < 10**15:
        raise ValueError(f"n={n} is outside [0, 10^15)")
    if n == 0:
        return "zero"
    parts = []
    for scale, word in SCALES:
        count, n = divmod(n, scale)
        if count:
            parts.append(f"{below_thousand(count)} {word}")
    if n:  # "two thousand and five": "and" before a last group under one hundred
        parts.append(("and " if parts and n < 100 else "") + below_thousand(n))
    return " ".join(parts)


def evaluate_terms(terms: list[int], ops: list[str]) -> Fraction:
    """Value of terms[0] ops[0] terms[1] ... with * and / before + and -."""
    sums, product = [], Fraction(terms[0])
    signs = [1]
    for op, term in zip(ops, terms[1:], strict=True):
        if op in "*/":
            product = product * term if op == "*" else product / term
            continue
        sums.append(signs[-1] * product)
        signs.append(1 if op == "+" else -1)
        product = Fraction(term)
    return sum(sums, Fraction(0)) + signs[-1] * product


class ArithmeticWordsTask:
    """Arithmetic problems written in words, with a numeric answer (see the module docstring)."""

    name = "arithmetic-words"

    def __init__(
        self,
        *,
        difficulty: str = "medium",
        num_digits: int | None = None,
        num_terms: int | None = None,
        ops: str | None = None,
        style: str = "chat",
        format_weight: float = 0.0,
    ) -> None:
        check_style(style)
        if difficulty not in LEVELS:
            raise ValueError(f"difficulty={difficulty!r} is invalid: one of {sorted(LEVELS)}")
        level_digits, level_terms, level_ops = LEVELS[difficulty]
        self.num_digits = level_digits if num_digits is None else num_digits
        self.num_terms = level_terms if num_terms is None else num_terms
        self.ops = level_ops if ops is None else ops
        if not isinstance(self.num_digits, int) or not 1 <= self.num_digits <= 12:
            raise ValueError(f"num_digits={self.num_digits!r} is invalid: an int in [1, 12]")
        if not isinstance(self.num_terms, int) or not 2 <= self.num_terms <= 5:
            raise ValueError(f"num_terms={self.num_terms!r} is invalid: an int in [2, 5]")
        if not self.ops or set(self.ops) - set(OPERATORS):
            raise ValueError(f"ops={self.ops!r} is invalid: a non-empty subset of '+-*/'")
        if not 0 <= format_weight < 1:
            raise ValueError(f"format_weight={format_weight!r} is invalid: must be in [0, 1)")
        self.style, self.format_weight = style, format_weight
        self.stop: tuple[str, ...] = (CLOSE,) if style == "chat" else ()

    def draw(self, rng: random.Random) -> tuple[list[int], list[str]]:
        """Terms and operators of one problem (each quotient exact)."""
        high = 10**self.num_digits
        ops: list[str] = []
        for _ in range(self.num_terms - 1):
            allowed = [o for o in self.ops if o != "/" or not ops or ops[-1] in "+-"]
            ops.append(rng.choice(allowed or [o for o in self.ops if o != "/"] or ["+"]))
        terms = [rng.randrange(high) for _ in range(self.num_terms)]
        for i, op in enumerate(ops):
            if op == "/":  # divisor in [1, min(high - 1, 12 * digits)], dividend a multiple
                divisor = rng.randint(1, max(1, min(high - 1, 12 * self.num_digits)))
                terms[i + 1], terms[i] = divisor, divisor * rng.randrange((high - 1) // divisor + 1)
        return terms, ops

    def sample(self, rng: random.Random) -> Problem:
        terms, ops = self.draw(rng)
        value = evaluate_terms(terms, ops)
        assert value.denominator == 1, "quotients are exact"
        words = number_words(terms[0]) + "".join(
            f" {OPERATORS[op]} {number_words(t)}" for op, t in zip(ops, terms[1:], strict=True)
        )
        answer = str(int(value))
        if self.style == "compact":
            return Problem(f"what is {words}?", answer)
        rule = " (times and divided by before plus and minus)" if self.num_terms > 2 else ""
        prompt = f"What is {words}?{rule} Give the final answer as a number in {OPEN} {CLOSE} tags."
        return Problem(prompt, f"{OPEN}{answer}{CLOSE}")

    def reward(self, problem: Problem, completion: str) -> float:
        value = numeric_answer(completion)
        if value is not None and value == numeric_answer(problem.answer):
            return 1.0
        return self.format_weight * format_reward(completion) if self.format_weight else 0.0

    def max_length(self) -> int:
        """Longest prompt + answer in characters (a bound: 12 characters a written digit)."""
        words = self.num_terms * (12 + 12 * self.num_digits)
        answer = self.num_terms * self.num_digits + 2
        return (120 if self.style == "chat" else 10) + words + 2 * answer
