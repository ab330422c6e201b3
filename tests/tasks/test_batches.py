import pytest
import torch

from birkhoff.model.mtp import shift_targets
from birkhoff.tasks.batches import batch_for_step, build_supervised_batch, prompt_ids
from birkhoff.tasks.problems import AdditionTask, Problem
from birkhoff.tokenizer import CharTokenizer


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


def test_supervised_batch_errors():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="problems is empty"):
        build_supervised_batch([], tok)


def test_prompt_ids_are_bos_and_the_prompt():
    tok = CharTokenizer()
    assert prompt_ids(Problem("1+2=", "3"), tok) == [tok.bos_id, *tok.encode("1+2=")]


def test_batches_are_a_function_of_seed_and_step():
    task, tok = AdditionTask(3), CharTokenizer()
    a = batch_for_step(task, tok, batch_size=8, seed=1, step=5)
    b = batch_for_step(task, tok, batch_size=8, seed=1, step=5)
    c = batch_for_step(task, tok, batch_size=8, seed=1, step=6)
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)
    assert a.input_ids.dtype == torch.int64 and a.loss_mask.dtype == torch.bool
