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
    if preset.init is None:  # else the vocabulary is the start checkpoint's
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


def test_smollm2_presets_are_twins():
    """smollm2-grpo and its dense twin differ only where S=1, M=0 forces them to: the model's
    streams and depth, the warm-up (nothing to distil) and the drafts."""
    up, dense = get_preset("smollm2-grpo"), get_preset("smollm2-grpo-dense")
    assert up.rl is not None and dense.rl is not None
    assert (up.model.num_streams, up.model.mtp_depth, up.rl.warmup) == (4, 1, "mtp-self-distill")
    assert dense.model == up.model.replace(num_streams=1, mtp_depth=0)
    assert dense.rl == up.rl.replace(warmup="supervised", warmup_steps=0, num_speculative_tokens=0)
    assert (dense.train, dense.task, dense.task_options, dense.init) == (
        up.train,
        up.task,
        up.task_options,
        up.init,
    )
    assert up.rl.num_eval_prompts >= 256 and 100 <= up.rl.max_new_tokens < 1000
    assert up.task_options["style"] == "chat" and up.init.endswith(".gguf")
