"""Reading an answer out of free text, and the format reward.

`extract_answer` reads, the first that applies winning: the last complete `<answer>...</answer>`
pair, else the last `\\boxed{...}`, else a fallback (`last_number` for numeric tasks, or the
whole text stripped). A reference answer goes through the same extraction, so it may be a whole
target completion or the bare value. `format_reward` is separate from correctness: 1.0 iff the
text holds exactly one non-empty answer tag pair with nothing but whitespace after it. The
rules in full: docs/tasks.md.
Left out: partial credit for near misses, <think> tags (what precedes the answer is not
checked).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

OPEN, CLOSE = "<answer>", "</answer>"
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
BOXED = "\\boxed{"
# a number: optional sign, digits with optional "," thousands groups, optional decimal part
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w])")

Fallback = Literal["number", "text"]


def tagged_answer(text: str) -> str | None:
    """Content of the last complete <answer>...</answer> pair, stripped; None without one."""
    matches = ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None


def boxed_answer(text: str) -> str | None:
    """Content of the last \\boxed{...} whose braces balance, stripped; None without one."""
    start = text.rfind(BOXED)
    while start >= 0:
        depth, i = 1, start + len(BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(BOXED) : i - 1].strip()
        start = text.rfind(BOXED, 0, start)
    return None


def last_number(text: str) -> str | None:
    """The last number written in `text` ("," thousands separators removed), or None."""
    matches = NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer(text: str, *, fallback: Fallback = "number") -> str | None:
    """The answer written in `text` (see the module docstring for the order), or None."""
    for found in (tagged_answer(text), boxed_answer(text)):
        if found is not None:
            return found
    return last_number(text) if fallback == "number" else (text.strip() or None)


def parse_exact_number(text: str | None) -> Fraction | None:
    """`text` as an exact number (integer or decimal, "," separators allowed), else None."""
    if text is None:
        return None
    text = text.strip().replace(",", "")
    if not re.fullmatch(r"[-+]?\d+(\.\d+)?", text) or len(text) > 100:
        return None
    return Fraction(text)


def numeric_answer(text: str) -> Fraction | None:
    """The extracted answer of `text` as an exact number; a tagged or boxed answer that is not
    a plain number (surrounding "$" allowed) gives None, never a number found elsewhere."""
    answer = extract_answer(text, fallback="number")
    return None if answer is None else parse_exact_number(answer.strip("$ "))


def format_reward(text: str) -> float:
    """1.0 iff the text ends with one well-formed <answer>...</answer> (see the docstring)."""
    if text.count(OPEN) != 1 or text.count(CLOSE) != 1:
        return 0.0
    rest = text.partition(OPEN)[2]
    content, _, tail = rest.partition(CLOSE)
    if not content.strip() or "<" in content or tail.strip():
        return 0.0
    return 1.0
