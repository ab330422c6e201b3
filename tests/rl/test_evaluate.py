"""The evaluation shared by the run's held-out curve and `birkhoff eval`: pass@k against
enumeration, figures and records consistent with the rollouts they come from."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from birkhoff.engine import Engine
from birkhoff.model import Transformer
from birkhoff.presets import tiny_cpu
from birkhoff.rl.evaluate import (
    completion_records,
    eval_figures,
    eval_metrics,
    evaluate,
    pass_at_k,
)
from birkhoff.tasks.problems import get_task, held_out_rng, sample_problems
from birkhoff.tokenizer import CharTokenizer


@pytest.mark.parametrize(("n", "c", "k"), [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 5, 4)])
def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_pass(n: int, c: int, k: int) -> None:
    samples = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(samples, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


def test_figures_and_records_follow_the_rollouts() -> None:
    preset, tok = tiny_cpu(), CharTokenizer()
    assert preset.rl is not None
    rl = preset.rl.replace(group_size=4, num_speculative_tokens=1)
    torch.manual_seed(0)
    model = Transformer(preset.model).eval()
    task = get_task(preset.task, **preset.task_options)
    problems = sample_problems(task, held_out_rng(0), 6)
    engine = Engine.from_model(model, max_batch_size=24)
    ev = evaluate(engine, problems, task, tok, rl, seed=3)
    # a reward is 0 or 1 on this task: make a few pass to exercise the counts
    ev = ev._replace(
        sampled=ev.sampled._replace(
            rewards_QW=torch.tensor(
                [[random.Random(i * 4 + j).random() < 0.4 for j in range(4)] for i in range(6)],
                dtype=torch.float32,
            )
        )
    )
    figures = eval_figures(ev, torch.device("cpu"))
    assert figures.items() >= eval_metrics(ev, torch.device("cpu")).items()
    passed = (ev.sampled.rewards_QW >= 1).sum(dim=1).tolist()
    assert figures["pass@1"] == pytest.approx(figures["eval_sampled_reward"])
    assert figures["pass@4"] == pytest.approx(sum(c > 0 for c in passed) / 6)
    assert set(figures) >= {"pass@1_greedy", "pass@2", "greedy_tokens_s", "sampled_tokens_s"}
    records = completion_records(ev, problems)
    assert len(records) == 6 * (1 + 4)
    sampled = [r for r in records if r["mode"] == "sampled"]
    assert [r["reward"] for r in sampled] == ev.sampled.rewards_QW.flatten().tolist()
    assert all(r["prompt"] == problems[r["problem"]].prompt for r in records)
    greedy = [r for r in records if r["mode"] == "greedy"]
    assert [r["completion"] for r in greedy] == [c.text for c in ev.greedy.completions]
