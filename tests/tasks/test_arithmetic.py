"""Arithmetic in words: number words, exact answers, difficulty levels, free-text rewards."""

from __future__ import annotations

import random

import pytest

from birkhoff.tasks.arithmetic import ArithmeticWordsTask, evaluate_terms, number_words
from birkhoff.tasks.problems import get_task, sample_problems
from birkhoff.tokenizer import CharTokenizer


@pytest.mark.parametrize(
    ("n", "words"),
    [
        (0, "zero"),
        (7, "seven"),
        (47, "forty-seven"),
        (106, "one hundred and six"),
        (110, "one hundred and ten"),
        (300, "three hundred"),
        (2005, "two thousand and five"),
        (12_345, "twelve thousand three hundred and forty-five"),
        (1_000_001, "one million and one"),
        (999_999_999_999_999, "nine hundred and ninety-nine trillion nine hundred and "
         "ninety-nine billion nine hundred and ninety-nine million nine hundred and "
         "ninety-nine thousand nine hundred and ninety-nine"),
    ],
)  # fmt: skip
def test_number_words(n: int, words: str) -> None:
    assert number_words(n) == words


def test_precedence() -> None:
    assert evaluate_terms([2, 3, 4], ["+", "*"]) == 14
    assert evaluate_terms([20, 4, 3], ["-", "-"]) == 13
    assert evaluate_terms([8, 4, 3], ["/", "*"]) == 6
    assert evaluate_terms([1, 8, 4], ["-", "/"]) == -1


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_problems_have_exact_answers(difficulty: str) -> None:
    task = get_task("arithmetic-words", difficulty=difficulty)
    assert isinstance(task, ArithmeticWordsTask)
    for problem in sample_problems(task, random.Random(0), 200):
        assert problem.prompt.startswith("What is ") and "<answer>" in problem.prompt
        assert task.reward(problem, problem.answer) == 1.0
        assert len(problem.prompt) + len(problem.answer) <= task.max_length()


def test_example_and_free_text_rewards() -> None:
    task = ArithmeticWordsTask(difficulty="easy", num_digits=3, ops="+")
    rng = random.Random(3)
    problem = task.sample(rng)
    answer = problem.answer.removeprefix("<answer>").removesuffix("</answer>")
    assert task.reward(problem, f"Adding them gives {answer}.") == 1.0  # the last number
    assert task.reward(problem, f"\\boxed{{{answer}}} hmm 0") == 1.0  # boxed before numbers
    assert task.reward(problem, f"<answer>{int(answer) + 1}</answer> {answer}") == 0.0
    assert task.reward(problem, "I do not know") == 0.0
    shaped = ArithmeticWordsTask(difficulty="easy", format_weight=0.1)
    assert shaped.reward(problem, "<answer>-1</answer>") == pytest.approx(0.1)


def test_compact_style_and_seeding() -> None:
    task = get_task("arithmetic-words", difficulty="easy", style="compact")
    problems = sample_problems(task, random.Random(0), 50)
    assert problems == sample_problems(task, random.Random(0), 50)
    tok = CharTokenizer()
    for problem in problems:
        tok.encode(problem.prompt + problem.answer)
        assert problem.prompt.startswith("what is ") and task.reward(problem, problem.answer)
    assert task.stop == () and get_task("arithmetic-words").stop == ("</answer>",)


def test_division_is_exact_and_options_override_the_level() -> None:
    task = ArithmeticWordsTask(difficulty="hard", ops="/*", num_terms=4)
    for problem in sample_problems(task, random.Random(1), 100):
        assert "divided by zero" not in problem.prompt
        assert task.reward(problem, problem.answer) == 1.0
    with pytest.raises(ValueError, match="num_digits"):
        ArithmeticWordsTask(num_digits=13)
    with pytest.raises(ValueError, match="difficulty"):
        ArithmeticWordsTask(difficulty="extreme")
