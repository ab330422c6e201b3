"""Answers read out of free text: tag, then boxed, then the last number; the format reward."""

from __future__ import annotations

from fractions import Fraction

import pytest

from birkhoff.tasks.answers import extract_answer, format_reward, numeric_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 12 + 3 = 15. <answer> 15 </answer>", "15"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last pair
        ("<answer>7</answer> and \\boxed{9}", "7"),  # a tag wins over boxed
        ("it is \\boxed{\\frac{1}{2}} or \\boxed{42}", "42"),  # the last boxed
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # braces balance
        ("\\boxed{3} \\boxed{unclosed", "3"),  # an unclosed boxed is skipped
        ("we get 1,234 apples, then 17.", "17"),  # the last number
        ("total: 1,234", "1234"),
        ("x = -5", "-5"),
        ("<answer>unclosed 3", "3"),  # no complete pair: falls through to the last number
        ("no number here", None),
        ("", None),
    ],
)
def test_extract_answer_order(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_text_fallback_is_the_whole_text() -> None:
    assert extract_answer("  (1+2)*3 \n", fallback="text") == "(1+2)*3"
    assert extract_answer("   ", fallback="text") is None


def test_numeric_answer_is_exact() -> None:
    assert numeric_answer("<answer>153</answer>") == 153
    assert numeric_answer("<answer> $1,234$ </answer>") == 1234
    assert numeric_answer("<answer>0.1</answer>") == Fraction(1, 10)
    # a tagged answer that is not a number is wrong, even when the text holds numbers elsewhere
    assert numeric_answer("12 + 3 = 15 <answer>fifteen</answer>") is None
    assert numeric_answer("1" * 500) is None  # absurdly long numbers are not parsed


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("think... <answer>15</answer>", 1.0),
        ("<answer>15</answer>  \n", 1.0),
        ("<answer>15</answer> and more", 0.0),  # text after the answer
        ("<answer>1</answer><answer>2</answer>", 0.0),  # two answers
        ("<answer>  </answer>", 0.0),  # empty
        ("<answer><answer>1</answer>", 0.0),  # nested / unbalanced
        ("<answer>1<b>2</answer>", 0.0),  # a tag inside
        ("</answer>1<answer>", 0.0),  # reversed
        ("15", 0.0),
    ],
)
def test_format_reward(text: str, reward: float) -> None:
    assert format_reward(text) == reward
