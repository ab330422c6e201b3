"""Stop strings: incremental text across tokens, truncation, plain and speculative decode alike."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from birkhoff.engine import Engine, SamplingParams
from birkhoff.engine.stop import StopText
from birkhoff.model import Transformer

# 16 token pieces for the vocab-16 test model: multi-character, so stop strings span tokens
PIECES = ["<", "/", "ans", "wer", ">", "wer>.", " ", "a", "b", "12", "3", "x", "y", "z", "</", "!"]


def detok(ids: Sequence[int]) -> str:
    return "".join(PIECES[int(t)] for t in ids)


def push_all(stop: StopText, ids: Sequence[int]) -> int | None:
    """Index of the token whose push completed a stop string, else None."""
    for i, t in enumerate(ids):
        if stop.push(t):
            return i
    return None


def test_a_stop_string_spanning_tokens_ends_at_the_completing_token() -> None:
    ids = [7, 14, 2, 3, 4, 8, 0]  # "a</answer>b<"
    stop = StopText(["</answer>"], detok)
    assert push_all(stop, ids) == 4 and stop.final_text() == "a</answer>"
    # the completing token carries characters past the stop string: cut from the text
    stop = StopText(["</answer>"], detok)
    assert push_all(stop, [7, 0, 1, 2, 5, 8]) == 4 and stop.final_text() == "a</answer>"
    # the earliest match wins among several stop strings
    stop = StopText(["wer>", "</ans"], detok)
    assert push_all(stop, [14, 2, 3, 4]) == 1 and stop.final_text() == "</ans"
    # no match: the whole text
    stop = StopText(["zz"], detok)
    assert push_all(stop, [11, 12, 13]) is None and stop.final_text() == "xyz"


def test_sentencepiece_leading_space_and_partial_utf8() -> None:
    """Decoders that drop a first token's leading space or need several tokens per character
    give the same text incrementally as decoded at once."""
    pieces = {0: " hello", 1: " world", 2: " stop", 3: " é"}

    def sp_decode(ids: Sequence[int]) -> str:  # strips the leading space, as Llama's does
        return "".join(pieces[int(t)] for t in ids).removeprefix(" ")

    stop = StopText(["world st"], sp_decode)
    assert push_all(stop, [0, 1, 3, 1, 2]) == 4 and stop.final_text() == "hello world é world st"

    raw = "é→</answer>".encode()  # one token per byte: multi-byte characters span tokens

    def byte_decode(ids: Sequence[int]) -> str:
        return bytes(raw[int(t)] for t in ids).decode("utf-8", errors="replace")

    stop = StopText(["→</ans"], byte_decode)
    assert push_all(stop, range(len(raw))) == len("é→</ans".encode()) - 1
    assert stop.final_text() == "é→</ans"


def test_sampling_params_stop_validation() -> None:
    assert SamplingParams(4, stop="</a>").stop == ("</a>",)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(4, stop=("",))
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(4, stop=(3,))  # type: ignore[arg-type]


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 0], [3, 5, 8, 13]]


def test_engine_stops_plain_and_speculative_alike(trained_model: Transformer) -> None:
    engine = Engine.from_model(trained_model, dtype=torch.float64, max_batch_size=4)
    with pytest.raises(ValueError, match="detokenize"):
        engine.generate(PROMPTS, SamplingParams(16, stop=("x",)))
    free = engine.generate(PROMPTS, SamplingParams(24), detokenize=detok)
    assert all(c.text == detok(c.tokens) for c in free)
    # a stop string spanning a token boundary inside the first completion's text
    first = free[0].tokens
    stop_text = detok(first[3:5])[-3:] + detok(first[5:6])[:2]
    for k in (0, 1, 2):
        params = SamplingParams(24, stop=(stop_text,), num_speculative_tokens=k)
        out = engine.generate(PROMPTS, params, detokenize=detok)
        for c, ref in zip(out, free, strict=True):
            text = detok(ref.tokens)
            end = text.find(stop_text)
            if end < 0:
                assert (c.tokens, c.text, c.finish_reason) == (ref.tokens, text, "length")
                continue
            end += len(stop_text)
            n = next(i for i in range(1, len(ref.tokens) + 1) if len(detok(ref.tokens[:i])) >= end)
            assert c.tokens == ref.tokens[:n], f"k={k}"
            assert c.logprobs == pytest.approx(ref.logprobs[:n], abs=1e-12)
            assert c.text == text[:end] and c.text.endswith(stop_text)
            assert c.finish_reason == "stop"
        assert out[0].finish_reason == "stop"


def test_hundreds_of_new_tokens(trained_model: Transformer) -> None:
    engine = Engine.from_model(trained_model, max_batch_size=2, max_seq_len=264)
    plain = engine.generate(PROMPTS[:2], SamplingParams(256))
    spec = engine.generate(PROMPTS[:2], SamplingParams(256, num_speculative_tokens=2))
    assert [len(c.tokens) for c in plain] == [256] * 2
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    assert all(c.finish_reason == "length" for c in plain + spec)
