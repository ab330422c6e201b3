import random

import pytest
import torch

from birkhoff.model.mtp import shift_targets
from birkhoff.rl.tasks import (
    AdditionTask,
    Problem,
    SortingTask,
    build_supervised_batch,
    get_task,
    sample_problems,
)
from birkhoff.tokenizer import CharTokenizer


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


def test_supervised_batch_hand_made():
    tok = CharTokenizer()
    batch = build_supervised_batch([Problem("1+2=", "3"), Problem("10+5=", "15")], tok)
    e = tok.encode
    row0 = [tok.bos_id, *e("1+2="), *e("3"), tok.eos_id, tok.pad_id, tok.pad_id]
    row1 = [tok.bos_id, *e("10+5="), *e("15"), tok.eos_id]
    assert batch.input_ids.tolist() == [row0, row1]
    assert batch.loss_mask.tolist() == [
        [False] * 5 + [True, True, False, False],
        [False] * 6 + [True, True, True],
    ]
    # In the model's convention, position i's main-head target is token i+1 with mask[i+1]:
    # the prompt's last token ('=') must predict the first answer token, EOS is the last target.
    targets, mask = shift_targets(batch.input_ids, batch.loss_mask, 1)
    assert targets[0][mask[0]].tolist() == [*e("3"), tok.eos_id]
    assert targets[1][mask[1]].tolist() == [*e("15"), tok.eos_id]
    assert mask[0].nonzero().flatten().tolist() == [4, 5]  # '=' at 4 predicts '3'


def test_supervised_batch_fixed_length_and_errors():
    tok = CharTokenizer()
    batch = build_supervised_batch([Problem("1+2=", "3")], tok, seq_len=12)
    assert batch.input_ids.shape == (1, 12) and batch.input_ids.dtype == torch.int64
    with pytest.raises(ValueError, match="seq_len=4"):
        build_supervised_batch([Problem("1+2=", "3")], tok, seq_len=4)
    with pytest.raises(ValueError, match="problems is empty"):
        build_supervised_batch([], tok)
