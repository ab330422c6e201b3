import pytest
import torch

from birkhoff.model import Transformer
from birkhoff.presets import PRESETS, get_preset
from birkhoff.tasks.problems import get_task
from birkhoff.tokenizer import CharTokenizer


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_consistent(name):
    preset = get_preset(name)
    assert preset.name == name
    assert preset.model.vocab_size == CharTokenizer().vocab_size
    task = get_task(preset.task, **preset.task_options)
    assert task.max_length() + 2 <= preset.model.max_seq_len  # bos + eos


def test_h200_small_is_about_120m_params():
    with torch.device("meta"):
        model = Transformer(get_preset("h200-small").model)
    num_params = sum(p.numel() for p in model.parameters())
    assert 100e6 < num_params < 140e6
    assert get_preset("h200-small").model.max_seq_len == 2048


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="'big'.*h200-grpo.*h200-small.*tiny-cpu"):
        get_preset("big")


def test_h200_learn_is_the_cpu_checked_run():
    """h200-learn is tiny-cpu's model, task and warm-up with a longer, wider GRPO phase: the
    configuration whose dynamics docs/results.md checked on CPU."""
    learn, tiny = get_preset("h200-learn"), get_preset("tiny-cpu")
    assert (learn.model, learn.train, learn.task, learn.task_options) == (
        tiny.model, tiny.train, tiny.task, tiny.task_options)  # fmt: skip
    assert learn.rl == tiny.rl.replace(
        num_steps=250, num_prompts=32, eval_every=25, checkpoint_every=50
    )
