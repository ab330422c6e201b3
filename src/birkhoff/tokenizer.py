"""A character-level tokenizer shipped in code, sized for the built-in tasks.

The vocabulary is fixed in code: pad 0, bos 1, eos 2, then digits, lowercase letters and the few
punctuation marks the task prompts use (under 64 ids). Special tokens have no text form, so a
prompt cannot inject an EOS; `decode` skips pad and bos and stops at the first eos.
`encode_prompt` puts a BOS before every prompt, as a HuggingFace tokenizer's post-processor adds
its own special tokens (the `Tokenizer` protocol). Unknown characters raise ValueError naming
the character and its position. Design choices: docs/tasks.md.
Left out: byte fallback, merges (BPE), uppercase; none of the built-in tasks need them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz +-*=,:;.?>()"
assert len(set(CHARACTERS)) == len(CHARACTERS), "one id per character"


class Tokenizer(Protocol):
    """What tasks, rollouts and generation use of a tokenizer (CharTokenizer, HFTokenizer).

    `encode(text)` gives the ids of the text alone; `encode_prompt(text)` the ids a generator is
    conditioned on, with whatever special tokens the tokenizer's own convention puts around a
    prompt (a post-processor's BOS, a chat template's role markers, or none). `bos_id` is only
    a token `decode` skips: no caller adds it on its own.
    """

    pad_id: int
    bos_id: int | None  # None: the tokenizer defines no BOS (Qwen)
    eos_id: int
    stop_ids: tuple[int, ...]  # generation ends at any of these (the EOS first)

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class CharTokenizer:
    """Character-level tokenizer: one id per character, plus pad/bos/eos special ids."""

    pad_id = 0
    bos_id: int | None = 1
    eos_id = 2
    stop_ids: tuple[int, ...] = (2,)

    characters = CHARACTERS

    def __init__(self) -> None:
        offset = len(SPECIAL_TOKENS)
        self._id_of = {c: i + offset for i, c in enumerate(CHARACTERS)}
        self._char_of = dict(enumerate(CHARACTERS, start=offset))

    @property
    def vocab_size(self) -> int:
        return len(SPECIAL_TOKENS) + len(self.characters)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of `text` (no special tokens added)."""
        ids = []
        for pos, char in enumerate(text):
            token = self._id_of.get(char)
            if token is None:
                raise ValueError(
                    f"character {char!r} at position {pos} of text {text!r} is not in the "
                    f"tokenizer vocabulary {self.characters!r}"
                )
            ids.append(token)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """[bos] + the ids of `text`: this tokenizer's prompt convention."""
        return [SPECIAL_TOKENS.index("<bos>"), *self.encode(text)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to (not including) the first eos; pad and bos are skipped."""
        chars = []
        for token in ids:
            token = int(token)
            if token == self.eos_id:
                break
            if token in (self.pad_id, self.bos_id):
                continue
            char = self._char_of.get(token)
            if char is None:
                raise ValueError(f"token id {token} is outside [0, {self.vocab_size})")
            chars.append(char)
        return "".join(chars)
