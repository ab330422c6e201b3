"""HuggingFace `tokenizer.json` tokenizers with the interface of birkhoff's CharTokenizer.

`HFTokenizer`, backed by the `tokenizers` library, provides exactly the `Tokenizer` protocol of
birkhoff/tokenizer.py: `pad_id`, `bos_id`, `eos_id`, `stop_ids`, `vocab_size`, `encode`,
`encode_prompt` and `decode`. Special tokens come from tokenizer_config.json (a missing EOS is
an error, a missing pad falls back to the EOS); `encode_prompt` applies the tokenizer's own
post-processor or, with `chat=True`, its chat template rendered as transformers renders it;
`encode` treats special-token strings as plain text unless `special=True`. The design choices
one by one are in docs/interop.md.
Left out: slow (sentencepiece .model) tokenizers, added-token options beyond tokenizer.json.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from birkhoff.tokenizer import CharTokenizer, Tokenizer


def token_content(value: object) -> str | None:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        return str(value["content"])
    return None if value is None else str(value)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def read_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The default chat template of a tokenizer directory, or None."""
    template = config.get("chat_template")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    if template is None:
        template = read_json(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


class HFTokenizer:
    """A `tokenizers.Tokenizer` with pad/bos/eos ids, encode/decode and a chat template."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_token: str,
        bos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
        chat: bool = False,
    ) -> None:
        if chat and chat_template is None:
            raise ValueError("chat=True is invalid: this tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.eos_id = self.token_id(eos_token, "eos_token")
        self.bos_id = None if bos_token is None else self.token_id(bos_token, "bos_token")
        self.pad_id = self.eos_id if pad_token is None else self.token_id(pad_token, "pad_token")
        self.special_tokens = {
            "eos_token": eos_token,
            "bos_token": bos_token or "",
            "pad_token": pad_token or eos_token,
        }
        self.chat_template = chat_template
        self.chat = chat  # prompts are user messages rendered through the chat template
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *extra_stop_ids]))

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], *, chat: bool = False) -> HFTokenizer:
        """Load tokenizer.json + tokenizer_config.json (+ generation_config.json) of a directory;
        `chat`: prompts go through its chat template."""
        from tokenizers import Tokenizer

        root = Path(directory)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(f"{root}: tokenizer.json not found")
        config = read_json(root / "tokenizer_config.json")
        eos = token_content(config.get("eos_token"))
        if eos is None:
            raise ValueError(f"{root / 'tokenizer_config.json'}: eos_token is missing")
        extra = read_json(root / "generation_config.json").get("eos_token_id") or []
        return cls(
            Tokenizer.from_file(str(root / "tokenizer.json")),
            eos_token=eos,
            bos_token=token_content(config.get("bos_token")),
            pad_token=token_content(config.get("pad_token")),
            chat_template=read_chat_template(root, config),
            extra_stop_ids=[extra] if isinstance(extra, int) else extra,
            chat=chat,
        )

    def token_id(self, token: str, field: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field}={token!r} is not in the tokenizer vocabulary")
        return int(token_id)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Ids of `text` (no special tokens added); special-token strings parsed iff `special`."""
        self.tokenizer.encode_special_tokens = not special
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        finally:
            self.tokenizer.encode_special_tokens = False

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a prompt: the chat template's user turn (`chat`), else the text with the
        post-processor's special tokens (none unless tokenizer.json's post-processor adds them).
        Special-token strings in `text` stay plain text."""
        if self.chat:
            return self.encode_chat([{"role": "user", "content": text}])
        self.tokenizer.encode_special_tokens = True
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=True).ids)
        finally:
            self.tokenizer.encode_special_tokens = False

    def encode_chat(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids of the rendered chat template (its markers parsed, no post-processor added)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, special=True)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to (not including) the first stop id (the EOS or another of
        `stop_ids`, where generation ends); pad and bos are skipped."""
        kept = []
        for token in ids:
            token = int(token)
            if token in self.stop_ids:
                break
            if token in (self.pad_id, self.bos_id):
                continue
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside [0, {self.vocab_size})")
            kept.append(token)
        return str(self.tokenizer.decode(kept, skip_special_tokens=False))

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat template rendered for `messages` (encode the result with special=True)."""
        if self.chat_template is None:
            raise ValueError("chat_template is missing: this tokenizer has no chat template")
        from jinja2.exceptions import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )


def checkpoint_tokenizer(directory: str | os.PathLike[str], *, chat: bool = False) -> Tokenizer:
    """The tokenizer of a checkpoint: HFTokenizer when it holds tokenizer.json (an imported
    model; `chat`: prompts through its chat template), else the built-in CharTokenizer."""
    if (Path(directory) / "tokenizer.json").is_file():
        return HFTokenizer.from_dir(directory, chat=chat)
    if chat:
        raise ValueError(f"{directory}: chat prompts need a checkpoint with tokenizer.json")
    return CharTokenizer()
