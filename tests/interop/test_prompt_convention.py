"""Prompts get special tokens only from the tokenizer's post-processor or its chat template.

Three conventions, built locally with `tokenizers`: a BOS token and no post-processor (SmolLM2:
no BOS added), a Llama-style TemplateProcessing (BOS added), and no BOS at all (Qwen). Each
prompt's ids equal transformers' tokenizer on the same files, plain and chat-templated, and a
tiny imported model continues the prompt exactly as transformers' generate does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_helpers import build_hf_model, save_hf_model
from test_hf_tokenizer import TEMPLATE, write_tokenizer

from birkhoff.engine import Engine, SamplingParams
from birkhoff.interop.hf import import_hf
from birkhoff.interop.tokenizer import HFTokenizer, checkpoint_tokenizer
from birkhoff.runtime.checkpoint import load_checkpoint
from birkhoff.tasks.batches import build_supervised_batch, prompt_ids
from birkhoff.tasks.problems import Problem

transformers = pytest.importorskip("transformers")

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVENTIONS = {  # name: (tokenizer_config.json, Llama-style BOS post-processor, BOS expected)
    "bos-no-template": (
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": TEMPLATE},
        False,
        False,
    ),
    "llama-template": (
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": LLAMA3_TEMPLATE},
        True,
        True,
    ),
    "qwen-none": (
        {"eos_token": "</s>", "pad_token": "<pad>", "chat_template": TEMPLATE},
        False,
        False,
    ),
}
TEXTS = ["12+34=", "the quick brown fox", " leading space", "a\n\nb  c"]


def write_convention(path: Path, name: str) -> Path:
    from tokenizers import processors

    config, bos_template, _ = CONVENTIONS[name]
    write_tokenizer(path, config)
    if bos_template:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
        )
        tok.save(str(path / "tokenizer.json"))
    return path


def reference(path: Path) -> object:
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("name", sorted(CONVENTIONS))
def test_prompt_ids_follow_the_tokenizer(name: str, tmp_path: Path) -> None:
    path = write_convention(tmp_path, name)
    ours, ref = HFTokenizer.from_dir(path), reference(path)
    expect_bos = CONVENTIONS[name][2]
    for text in TEXTS:
        ids = ours.encode_prompt(text)
        assert ids == ref(text).input_ids
        assert (ids[0] == ours.bos_id) == expect_bos
        assert ids == prompt_ids(Problem(text, "7"), ours)
        assert ours.decode(ids) == text  # the BOS is skipped
    injected = ours.encode_prompt("</s> is text")  # special-token strings in text stay text
    assert ours.eos_id not in injected and ours.decode(injected) == "</s> is text"
    batch = build_supervised_batch([Problem("1+2=", "3")], ours)
    assert batch.input_ids[0].tolist() == [
        *ours.encode_prompt("1+2="),
        *ours.encode("3"),
        ours.eos_id,
    ]


@pytest.mark.parametrize("name", sorted(CONVENTIONS))
def test_chat_prompts_follow_the_template(name: str, tmp_path: Path) -> None:
    path = write_convention(tmp_path, name)
    ours, ref = HFTokenizer.from_dir(path, chat=True), reference(path)
    for text in TEXTS:
        messages = [{"role": "user", "content": text}]
        expected = ref.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert ours.encode_prompt(text) == expected
        # both templates write {{ bos_token }}: one BOS where one exists, never a second one
        # from the post-processor
        assert expected.count(ours.bos_id) == (ours.bos_id is not None)


def test_chat_needs_a_template(tmp_path: Path) -> None:
    path = write_tokenizer(tmp_path / "t", {"eos_token": "</s>"})
    with pytest.raises(ValueError, match="chat=True"):
        HFTokenizer.from_dir(path, chat=True)
    with pytest.raises(ValueError, match="tokenizer.json"):
        checkpoint_tokenizer(tmp_path / "empty", chat=True)


@pytest.mark.parametrize("name", ["bos-no-template", "llama-template"])
def test_continuation_equals_transformers(name: str, tmp_path: Path) -> None:
    """A tokenizer naming a BOS without adding one: birkhoff continues the prompt as
    transformers does (a BOS guessed from `bos_id` would change the continuation)."""
    path = write_convention(tmp_path / "hf", name)
    vocab = HFTokenizer.from_dir(path).vocab_size
    hf_model = build_hf_model("llama-gqa", vocab_size=vocab)
    save_hf_model(hf_model, path)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == vocab
    import_hf(path, tmp_path / "ckpt")
    tok, ref = checkpoint_tokenizer(tmp_path / "ckpt"), reference(path)
    engine = Engine.from_model(load_checkpoint(tmp_path / "ckpt").model.eval())
    for text in TEXTS[:2]:
        ids = tok.encode_prompt(text)
        ours = engine.generate([ids], SamplingParams(8))[0].tokens
        with torch.no_grad():
            out = hf_model.generate(
                **ref(text, return_tensors="pt"),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert ours == out[0, len(ids) :].tolist()
