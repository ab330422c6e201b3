"""Countdown: the exact evaluator (no eval of model text), generation, the task's reward."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from birkhoff.tasks.countdown import (
    CountdownTask,
    ExpressionError,
    evaluate,
    generate,
    is_solution,
)
from birkhoff.tasks.problems import Problem, get_task, held_out_rng, sample_problems, step_rng
from birkhoff.tasks.verifiers import get_verifier


def test_evaluate_is_exact_with_precedence() -> None:
    assert evaluate("7/2*2") == (Fraction(7), [7, 2, 2])
    assert evaluate("2+3*4") == (Fraction(14), [2, 3, 4])
    assert evaluate("(2+3)*4") == (Fraction(20), [2, 3, 4])
    assert evaluate(" 10 - 4 - 3 ") == (Fraction(3), [10, 4, 3])  # left-associative
    assert evaluate("1/3+1/3+1/3")[0] == 1  # no float rounding


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('echo hi')",
        "2**999999999",  # exponent: not an operator here
        "9" * 400,  # too long
        "1234567+1",  # a number literal of more than 6 digits
        "1/0",
        "5/(3-3)",
        "(1+2",
        "1+2)",
        "((((1))))" + ")",
        "(" * 40 + "1" + ")" * 40,  # nested too deep
        "-3+5",  # no unary minus
        "3+-5",
        "3.5*2",
        "1e3",
        "3 4",
        "3+",
        "",
        "2 = 2",
        "07+1",  # leading zero
        "lambda: 1",
        "1 + 2\x00",
    ],
)
def test_evaluate_rejects(text: str) -> None:
    with pytest.raises(ExpressionError):
        evaluate(text)


def test_solution_uses_each_given_number_exactly_once() -> None:
    numbers, target = [3, 5, 7], 22
    assert is_solution("3*5+7", numbers, target)
    assert is_solution("(7 + 5*3)", numbers, target)
    assert not is_solution("3*5+7+0", numbers, target)  # a number not given
    assert not is_solution("3*7+1", numbers, target)  # a number not given
    assert not is_solution("5*5-3", numbers, target)  # 5 reused, 7 unused
    assert not is_solution("3*5+7", numbers, 23)  # wrong value
    assert not is_solution("5*3", [5, 3, 7], 15)  # 7 unused: exactly once is the rule
    assert is_solution("5*3", [5, 3, 7], 15, use_all=False)  # at most once
    assert not is_solution("5*5", [5, 3, 7], 25, use_all=False)
    assert not is_solution("__import__('os')", numbers, target)


def test_generated_instances_are_solvable_and_seeded() -> None:
    rng = random.Random(0)
    for _ in range(300):
        inst = generate(rng, num_numbers=4, max_number=100, max_target=100, ops="+-*/")
        assert 1 <= inst.target <= 100 and len(inst.numbers) == 4
        assert is_solution(inst.solution, inst.numbers, inst.target), inst
    a = generate(random.Random(5), num_numbers=3, max_number=20, max_target=50, ops="+-*")
    b = generate(random.Random(5), num_numbers=3, max_number=20, max_target=50, ops="+-*")
    assert a == b and "/" not in a.solution


def test_task_prompts_and_rewards() -> None:
    task = get_task("countdown", num_numbers=3, max_number=20)
    assert isinstance(task, CountdownTask) and task.stop == ("</answer>",)
    problem = task.sample(random.Random(1))
    assert problem.prompt.startswith("Using the numbers [") and "<answer>" in problem.prompt
    assert task.reward(problem, problem.answer) == 1.0  # the reference solves it
    solution = problem.answer.removeprefix("<answer>").removesuffix("</answer>")
    assert task.reward(problem, f"Let me think. {solution} works.\n<answer>{solution}</answer>")
    assert task.reward(problem, solution) == 1.0  # no tag: the whole text is the expression
    assert task.reward(problem, "<answer>1+1</answer>") == 0.0
    shaped = get_task("countdown", num_numbers=3, max_number=20, format_weight=0.1)
    assert shaped.reward(problem, "<answer>1+1</answer>") == pytest.approx(0.1)
    assert shaped.reward(problem, "1+1") == 0.0


def test_compact_style_fits_the_character_tokenizer() -> None:
    from birkhoff.tokenizer import CharTokenizer

    task = get_task("countdown", num_numbers=3, max_number=20, style="compact")
    tok = CharTokenizer()
    for problem in sample_problems(task, random.Random(0), 50):
        tok.encode(problem.prompt + problem.answer)  # raises on characters outside the vocab
        assert len(problem.prompt) + len(problem.answer) <= task.max_length()
        assert task.reward(problem, problem.answer) == 1.0
    assert task.stop == ()


def test_train_and_held_out_streams_differ() -> None:
    task = get_task("countdown")
    train = sample_problems(task, step_rng(0, 0), 8)
    assert train == sample_problems(task, step_rng(0, 0), 8)  # deterministic
    assert train != sample_problems(task, held_out_rng(0), 8)


def test_countdown_verifier_for_jsonl_answers() -> None:
    check = get_verifier("countdown")
    check.check_answer("(3+5)*7")
    with pytest.raises(ValueError, match="not a Countdown expression"):
        check.check_answer("3+")
    assert check(Problem("q", "(3+5)*7"), "<answer>7*(5+3)</answer>") == 1.0
    assert check(Problem("q", "(3+5)*7"), "<answer>56</answer>") == 0.0


def test_bad_options_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_numbers"):
        get_task("countdown", num_numbers=9)
    with pytest.raises(ValueError, match="ops"):
        get_task("countdown", ops="+^")
    with pytest.raises(ValueError, match="style"):
        get_task("countdown", style="fancy")
    with pytest.raises(ValueError, match="bad options"):
        get_task("countdown", colour="red")
