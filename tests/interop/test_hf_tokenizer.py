"""HFTokenizer: a BPE tokenizer trained locally round-trips text and special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from birkhoff.interop.tokenizer import HFTokenizer

tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["12+34=46", "the quick brown fox jumps over the lazy dog", "sort: dcba = abcd"] * 20


def write_tokenizer(directory: Path, config: dict, *, generation: dict | None = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(TEXTS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


CONFIG = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>",
          "chat_template": TEMPLATE}  # fmt: skip


def test_text_and_special_tokens_round_trip(tmp_path: Path) -> None:
    tok = HFTokenizer.from_dir(write_tokenizer(tmp_path, CONFIG, generation={"eos_token_id": [4]}))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.stop_ids == (2, 4) and tok.vocab_size >= len(SPECIALS)
    for text in ["12+34=46", "Hello, Wörld! ✓ 3.14", " leading and trailing "]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode([tok.bos_id, *ids, tok.eos_id, 7, 8, tok.pad_id]) == text
    chat = "<|im_start|>user\nhi<|im_end|>"
    parsed = tok.encode(chat, special=True)
    assert parsed[0] == 3 and 4 in parsed  # role markers are single special ids
    assert tok.decode(parsed) == "<|im_start|>user\nhi"  # decode ends at a stop id (4 here)
    plain = tok.encode(chat + "</s>")  # user text cannot inject special tokens
    assert not set(plain) & {0, 1, 2, 3, 4}
    assert tok.decode(plain) == chat + "</s>"


def test_chat_template_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    write_tokenizer(tmp_path, CONFIG)
    ours = HFTokenizer.from_dir(tmp_path)
    ref = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", chat_template=TEMPLATE,
    )  # fmt: skip
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}]
    for gen in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=gen)
        assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.encode(text, special=True) == ref.encode(text, add_special_tokens=False)


def test_missing_and_unknown_special_tokens(tmp_path: Path) -> None:
    no_bos = {"eos_token": "</s>"}
    tok = HFTokenizer.from_dir(write_tokenizer(tmp_path / "a", no_bos))
    assert tok.bos_id is None and tok.pad_id == tok.eos_id
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="eos_token"):
        HFTokenizer.from_dir(write_tokenizer(tmp_path / "b", {"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="pad_token='<nope>'"):
        HFTokenizer.from_dir(write_tokenizer(tmp_path / "c", {**no_bos, "pad_token": "<nope>"}))
    with pytest.raises(ValueError, match="outside"):
        tok.decode([10**6])
    with pytest.raises(ValueError, match="tokenizer.json"):
        HFTokenizer.from_dir(tmp_path / "nothing")


def test_template_from_jinja_file(tmp_path: Path) -> None:
    write_tokenizer(tmp_path, {"eos_token": "</s>"})
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}{{ eos_token }}")
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi</s>"


def test_jsonl_lengths_are_checked_in_tokens(tmp_path: Path) -> None:
    from birkhoff.tasks.jsonl import DataError, load_jsonl_tasks

    tok = HFTokenizer.from_dir(write_tokenizer(tmp_path / "tok", CONFIG))
    lines = [json.dumps({"prompt": "the quick brown fox", "answer": "dog"})] * 3
    lines.append(json.dumps({"prompt": "Zebra " * 20, "answer": "x"}))
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    with pytest.raises(
        DataError, match=r"d\.jsonl:4: \d+ tokens \(framed prompt, answer, eos\) > max_seq_len=16"
    ):
        load_jsonl_tasks(tmp_path / "d.jsonl", tokenizer=tok, max_seq_len=16)
    splits = load_jsonl_tasks(tmp_path / "d.jsonl", tokenizer=tok, max_seq_len=128)
    assert len(splits.train.problems) + len(splits.eval.problems) == 4
