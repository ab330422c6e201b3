"""GGUF pieces that need no file: the q/k un-permutation, metadata checks, the tokenizer rebuild."""

from __future__ import annotations

import pytest
import torch

from birkhoff.interop.gguf import hf_config_from_gguf, hf_tensor_name, unpermute
from birkhoff.interop.gguf_tokenizer import build_tokenizer, pre_tokenizer, tokenizer_config

pytest.importorskip("tokenizers")

META = {
    "general.architecture": "llama",
    "llama.embedding_length": 32,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.feed_forward_length": 48,
    "llama.block_count": 2,
    "llama.context_length": 128,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.freq_base": 500.0,
    "llama.vocab_size": 97,
}


def llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's `permute`: per head, the two rotary halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2)


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_unpermute_inverts_llama_cpp(num_heads: int) -> None:
    w = torch.randn(num_heads * 8, 5)
    permuted = llama_cpp_permute(w, num_heads).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute(permuted, num_heads), w)


def test_names_and_config() -> None:
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("rope_freqs.weight") is None  # reported as an unknown tensor
    hf = hf_config_from_gguf(META, tied=True)
    assert (hf["head_dim"], hf["num_key_value_heads"], hf["tie_word_embeddings"]) == (8, 2, True)
    assert hf["rope_theta"] == 500.0 and hf["max_position_embeddings"] == 128


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"general.architecture": "qwen2"}, "general.architecture"),
        ({"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.type"),
        ({"llama.rope.dimension_count": 4}, "llama.rope.dimension_count"),
        ({"llama.block_count": None}, "llama.block_count"),
    ],
)
def test_unsupported_metadata_names_the_key(change: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        hf_config_from_gguf({**META, **change}, tied=False)


def tiny_vocab(**extra: object) -> dict:
    tokens = ["<s>", "</s>", "<|im_start|>", "a", "b", "c", "ab", "Ġ", "Ġa", "1", "2", "<think>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 4],
        "tokenizer.ggml.merges": ["a b", "Ġ a"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        **extra,
    }


def test_tokenizer_from_metadata() -> None:
    tok = build_tokenizer(tiny_vocab())
    assert tok.encode("ab a12", add_special_tokens=False).ids == [6, 8, 9, 10]
    assert tok.encode("<|im_start|>a<think>").ids == [2, 3, 11]  # added tokens match whole
    assert tok.encode("ab").ids == [6]  # no add_bos_token: no BOS
    with_bos = build_tokenizer(tiny_vocab(**{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("ab").ids == [0, 6]
    config = tokenizer_config(tiny_vocab(**{"tokenizer.chat_template": "{{ x }}"}))
    assert (config["bos_token"], config["eos_token"], config["chat_template"]) == (
        "<s>",
        "</s>",
        "{{ x }}",
    )


def test_unsupported_tokenizers_name_the_key() -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.model='llama'"):
        build_tokenizer(tiny_vocab(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='qwen2'"):
        pre_tokenizer("qwen2", add_prefix_space=False)
    with pytest.raises(ValueError, match="eos_token_id"):
        tokenizer_config({"tokenizer.ggml.tokens": ["a"]})
