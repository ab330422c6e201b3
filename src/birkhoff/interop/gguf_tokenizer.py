"""A `tokenizers` tokenizer rebuilt from a GGUF file's metadata (byte-level BPE).

A GGUF file has no tokenizer.json: llama.cpp stores the vocabulary, merges, special token ids,
BOS/EOS flags, the pre-tokenizer's name and the chat template as metadata. `tokenizer_files`
turns them into the tokenizer.json + tokenizer_config.json that `HFTokenizer.from_dir` reads, so
an imported checkpoint carries its tokenizer like an imported HuggingFace directory. The
pre-tokenizer follows llama.cpp's split for the named `pre`; CONTROL tokens become special added
tokens, USER_DEFINED plain ones. Design choices in detail: docs/interop.md.
Left out: sentencepiece (`llama`) and unigram (`t5`) vocabularies, pre-tokenizers not listed in
`SPLITS`.
"""

from __future__ import annotations

import json
from typing import Any

CONTROL, USER_DEFINED = 3, 4
GPT2_SPLIT = None  # ByteLevel's built-in GPT-2 regex
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer name -> (split digits one by one first, regex or None for GPT-2's)
SPLITS: dict[str, tuple[bool, str | None]] = {
    "default": (False, GPT2_SPLIT),
    "gpt-2": (False, GPT2_SPLIT),
    "smollm": (True, GPT2_SPLIT),
    "starcoder": (True, GPT2_SPLIT),
    "refact": (True, GPT2_SPLIT),
    "llama-bpe": (False, LLAMA3_SPLIT),
    "llama3": (False, LLAMA3_SPLIT),
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def spelled(token: str, alphabet: dict[int, str], letters: set[str]) -> str:
    """`token` in the byte alphabet (unchanged when it already is)."""
    if set(token) <= letters:
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def pre_tokenizer(pre: str, *, add_prefix_space: bool) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre not in SPLITS:
        raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported: known {sorted(SPLITS)}")
    digits, regex = SPLITS[pre]
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def post_processor(tokens: list[str], meta: dict[str, Any]) -> Any:
    """BOS / EOS around a text only where the file's flags ask for them (else None)."""
    from tokenizers import processors

    single, specials = "$A", []
    for which, side in (("bos", "left"), ("eos", "right")):
        token_id = meta.get(f"tokenizer.ggml.{which}_token_id")
        if not meta.get(f"tokenizer.ggml.add_{which}_token") or token_id is None:
            continue
        token = tokens[int(token_id)]
        single = f"{token} {single}" if side == "left" else f"{single} {token}"
        specials.append((token, int(token_id)))
    if not specials:
        return None
    return processors.TemplateProcessing(single=single, special_tokens=specials)


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """The `tokenizers.Tokenizer` that GGUF metadata `meta` (key -> value) describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model={kind!r} is not supported: byte-level BPE (gpt2)")
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    tokens = [spelled(t, alphabet, letters) for t in meta["tokenizer.ggml.tokens"]]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tokenizer.pre_tokenizer = pre_tokenizer(
        str(meta.get("tokenizer.ggml.pre", "default")), add_prefix_space=add_prefix_space
    )
    tokenizer.decoder = decoders.ByteLevel()
    processor = post_processor(tokens, meta)
    if processor is not None:
        tokenizer.post_processor = processor
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    raw = meta["tokenizer.ggml.tokens"]
    typed = list(zip(raw, types, strict=True))
    # a control token outside the byte alphabet is a mislabel: adding it would grow the vocab
    control = [t for t, kind in typed if kind == CONTROL and set(t) <= letters]
    user = [t for t, kind in typed if kind == USER_DEFINED and t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tokenizer


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by content, the flags, the chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    keys = {
        "bos_token": "bos_token_id",
        "eos_token": "eos_token_id",
        "pad_token": "padding_token_id",
        "unk_token": "unknown_token_id",
    }
    for name, key in keys.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[name] = tokens[int(token_id)]
    if "eos_token" not in config:
        raise ValueError("tokenizer.ggml.eos_token_id is missing: generation could never stop")
    if meta.get("tokenizer.chat_template") is not None:
        config["chat_template"] = str(meta["tokenizer.chat_template"])
    return config


def tokenizer_files(meta: dict[str, Any]) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json of the GGUF metadata `meta`."""
    return {
        "tokenizer.json": build_tokenizer(meta).to_str().encode(),
        "tokenizer_config.json": json.dumps(tokenizer_config(meta), indent=2).encode(),
    }
