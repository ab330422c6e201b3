"""Stop strings: generation of a request ends once its decoded text contains one of them.

A stop string may span tokens, so each request with stop strings keeps its completion's text up
to date as tokens arrive (`push`), decoding incrementally as vLLM's detokenizer does, and
searches only the text that could hold a new match. A stopped completion's tokens end with the
token that completed the stop string, and its text ends with the stop string, included
(characters the last token carries past it are cut). Incremental decoding and its edge cases:
docs/engine.md.
Left out: stop conditions other than strings and token ids (regexes, logits processors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Detokenize = Callable[[Sequence[int]], str]
REPLACEMENT = "\ufffd"  # what a decoder gives for an unfinished UTF-8 sequence


class StopText:
    """The decoded text of one request's completion, and whether a stop string ended it."""

    def __init__(self, stop: Sequence[str], detokenize: Detokenize) -> None:
        self.stop, self.detokenize = tuple(stop), detokenize
        self.longest = max((len(s) for s in self.stop), default=0)
        self.tokens: list[int] = []
        self.text = ""
        self.prefix = self.read = 0  # tokens[prefix:read]: context; tokens[read:]: unread
        self.stopped = False

    def push(self, token: int) -> bool:
        """Add one generated token; whether a stop string is now complete (text cut after it)."""
        self.tokens.append(token)
        if not self.stop:
            return False
        context = self.detokenize(self.tokens[self.prefix : self.read])
        full = self.detokenize(self.tokens[self.prefix :])
        if len(full) <= len(context) or full.endswith(REPLACEMENT):
            return False  # nothing complete to read yet
        searched_from = max(0, len(self.text) - self.longest + 1)
        self.text += full[len(context) :]
        self.prefix, self.read = self.read, len(self.tokens)
        ends = [self.text.find(s, searched_from) for s in self.stop]
        ends = [i + len(s) for i, s in zip(ends, self.stop, strict=True) if i >= 0]
        if not ends:
            return False
        self.text, self.stopped = self.text[: min(ends)], True
        return True

    def final_text(self) -> str:
        """The completion's text: cut after its stop string, else every token decoded."""
        return self.text if self.stopped else self.detokenize(self.tokens)
