"""Continuous batching: the scheduler, and generate calls with more prompts than rows."""

from __future__ import annotations

import copy

import torch
from engine_helpers import tiny_config

from birkhoff.engine import Engine, SamplingParams
from birkhoff.engine.scheduler import Scheduler
from birkhoff.model import Transformer

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 0], [3, 5, 8, 13], [2], [9, 9]]


def test_scheduler_refills_the_lowest_free_rows_in_request_order() -> None:
    sched = Scheduler(num_requests=5, num_rows=3)
    assert sched.admit() == [(0, 0), (1, 1), (2, 2)] and sched.admit() == []
    assert sched.release(1) == 1 and sched.release(0) == 0
    assert sched.active_rows == [2]
    assert sched.admit() == [(0, 3), (1, 4)]
    assert sched.active_rows == [0, 1, 2] and not sched.done
    for row in (2, 0, 1):
        sched.release(row)
    assert sched.admit() == [] and sched.done


def mixed_params(k: int, temperature: float) -> list[SamplingParams]:
    """Per-request lengths, stops and sampling: rows finish at different steps."""
    return [
        SamplingParams(
            max_new_tokens=3 + (5 * i) % 11,
            temperature=temperature * (1 + i % 2) / 2,
            top_k=4 * (i % 2),
            stop_token_ids=(7,) if i % 3 == 0 else (),
            seed=5,
            num_speculative_tokens=k,
        )  # fmt: skip
        for i in range(len(PROMPTS))
    ]


def test_completions_do_not_depend_on_batch_composition(trained_model: Transformer) -> None:
    """fp64: a request gives the same tokens whatever requests share its batch,
    for any max_batch_size (rows are refilled mid-call when it is smaller than the call)."""
    model = copy.deepcopy(trained_model).double()
    for k in (0, 2):
        for temperature in (0.0, 1.0):
            params = mixed_params(k, temperature)
            runs = []
            for rows in (1, 3, 8):
                engine = Engine.from_model(model, dtype=torch.float64, max_batch_size=rows)
                runs.append(engine.generate(PROMPTS, params))
            for other in runs[1:]:  # tokens exactly; logprobs to batch-size-dependent rounding
                assert [c.tokens for c in other] == [c.tokens for c in runs[0]]
                assert [c.finish_reason for c in other] == [c.finish_reason for c in runs[0]]
                torch.testing.assert_close(
                    [c.logprobs for c in other], [c.logprobs for c in runs[0]], rtol=0,
                    atol=1e-12,
                )  # fmt: skip
            lengths = {len(c.tokens) for c in runs[0]}
            assert len(lengths) > 2  # rows really finished at different steps


def test_more_prompts_than_rows_equals_plain_greedy_one_by_one() -> None:
    torch.manual_seed(0)
    model = Transformer(tiny_config()).double().eval()
    engine = Engine.from_model(model, dtype=torch.float64, max_batch_size=2)
    out = engine.generate(PROMPTS, SamplingParams(6))
    assert len(out) == len(PROMPTS) and all(c.weight_version == 0 for c in out)
    for prompt, completion in zip(PROMPTS, out, strict=True):
        alone = engine.generate([prompt], SamplingParams(6))[0]
        assert completion.tokens == alone.tokens
        torch.testing.assert_close(completion.logprobs, alone.logprobs, rtol=0, atol=1e-12)
