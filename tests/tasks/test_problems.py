import random

import pytest

from birkhoff.tasks.problems import (
    AdditionTask,
    Problem,
    SortingTask,
    get_task,
    held_out_rng,
    sample_problems,
    sampling_seed,
    step_rng,
)


@pytest.mark.parametrize("task", [AdditionTask(3), SortingTask(5)])
def test_answers_are_correct_and_rewarded(task):
    for problem in sample_problems(task, random.Random(0), 200):
        assert task.reward(problem, problem.answer) == 1.0
        assert task.reward(problem, problem.answer + "0") == 0.0
        assert task.reward(problem, "") == 0.0
        assert len(problem.prompt) + len(problem.answer) <= task.max_length()


def test_addition_is_arithmetic():
    for problem in sample_problems(AdditionTask(4), random.Random(1), 100):
        a, b = problem.prompt.rstrip("=").split("+")
        assert int(problem.answer) == int(a) + int(b)
        assert int(a) < 10**4 and int(b) < 10**4


def test_sorting_sorts():
    for problem in sample_problems(SortingTask(7, alphabet="a1b2c"), random.Random(2), 100):
        chars = problem.prompt.removeprefix("sort:").rstrip("=")
        assert len(chars) == 7 and set(chars) <= set("a1b2c")
        assert problem.answer == "".join(sorted(chars))


def test_reward_is_exact_match_only():
    task = AdditionTask(3)
    problem = Problem("123+456=", "579")
    assert task.reward(problem, "579") == 1.0
    for wrong in ("0579", "579 ", " 579", "578", "57"):
        assert task.reward(problem, wrong) == 0.0


def test_seeded_determinism():
    for task in (AdditionTask(3), SortingTask(6)):
        first = sample_problems(task, random.Random(7), 50)
        assert first == sample_problems(task, random.Random(7), 50)
        assert first != sample_problems(task, random.Random(8), 50)


def test_registry():
    assert isinstance(get_task("addition", num_digits=2), AdditionTask)
    assert get_task("sorting", length=3).length == 3
    with pytest.raises(ValueError, match="'multiply'.*addition"):
        get_task("multiply")
    with pytest.raises(ValueError, match="num_digits=0"):
        get_task("addition", num_digits=0)


def test_seed_streams_are_functions_of_seed_and_step_and_disjoint():
    task = AdditionTask(3)
    assert sample_problems(task, step_rng(1, 5), 8) == sample_problems(task, step_rng(1, 5), 8)
    streams = [step_rng(1, 5), step_rng(1, 6), step_rng(2, 5), held_out_rng(1), held_out_rng(2)]
    drawn = [tuple(sample_problems(task, rng, 8)) for rng in streams]
    assert len(set(drawn)) == len(drawn)
    seeds = {sampling_seed(seed, step) for seed in range(3) for step in range(1000)}
    assert len(seeds) == 3000
