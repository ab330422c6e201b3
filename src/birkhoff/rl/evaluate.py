"""Evaluation by generation: the run's held-out curve and `birkhoff eval` are this one code.

`evaluate` generates with the engine on a fixed list of problems: one greedy completion each and
`group_size` seeded samples each at the rollout temperature (both drafted by MTP when the model
has depths), scored by the task's reward, exactly as the rollouts are (`rollout`).
`eval_metrics` turns that into the run's `eval_*` columns; `eval_figures` adds what a user asks
of a checkpoint: pass@1 greedy, pass@k of the samples (the unbiased estimator of Chen et al.
2021, a completion passing when its reward is full, >= 1), mean rewards and tokens per second;
`completion_records` are the completions themselves, one JSON object each.
Legend: Q problems, W samples per problem.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from birkhoff.engine import Engine
from birkhoff.rl.config import RLConfig
from birkhoff.rl.reduce import rollout_metrics
from birkhoff.rl.rollout import Rollout, rollout
from birkhoff.tasks.problems import Problem, Task
from birkhoff.tokenizer import Tokenizer

PASS_REWARD = 1.0  # a completion passes when its reward reaches this (full credit)


class Evaluation(NamedTuple):
    greedy: Rollout  # rewards [Q,1]
    sampled: Rollout  # rewards [Q,W]


def evaluate(
    engine: Engine,
    problems: Sequence[Problem],
    task: Task,
    tokenizer: Tokenizer,
    cfg: RLConfig,
    *,
    seed: int,
) -> Evaluation:
    """Greedy and `cfg.group_size` sampled completions of every problem, scored."""
    greedy = rollout(engine, problems, task, tokenizer, cfg, seed=seed, greedy=True)
    sampled = rollout(engine, problems, task, tokenizer, cfg, seed=seed)
    return Evaluation(greedy, sampled)


def eval_metrics(ev: Evaluation, device: torch.device) -> dict[str, float]:
    """The run's eval row: greedy reward, sampled reward, greedy MTP acceptance (over ranks)."""
    greedy = rollout_metrics(ev.greedy, device)
    sampled = rollout_metrics(ev.sampled, device)
    out = {"eval_reward": greedy["reward"], "eval_sampled_reward": sampled["reward"]}
    out.update({f"eval_{k}": v for k, v in greedy.items() if k.startswith("accept_")})
    return out


def pass_at_k(num_samples: int, num_passed: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n passes), c of n passing."""
    if num_samples - num_passed < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_passed, k) / math.comb(num_samples, k)


def tokens_per_second(ro: Rollout) -> float:
    return sum(len(c.tokens) for c in ro.completions) / max(ro.seconds, 1e-9)


def eval_figures(ev: Evaluation, device: torch.device) -> dict[str, float]:
    """`eval_metrics` plus pass@1 greedy, pass@k for k = 1, 2, 4, ... up to W, tokens/s."""
    out: dict[str, float] = dict(eval_metrics(ev, device))
    passed_Q1 = ev.greedy.rewards_QW >= PASS_REWARD
    out["pass@1_greedy"] = float(passed_Q1.float().mean())
    passed_QW = ev.sampled.rewards_QW >= PASS_REWARD
    num_samples = passed_QW.shape[1]
    ks = sorted(
        {2**i for i in range(num_samples.bit_length()) if 2**i <= num_samples} | {num_samples}
    )
    for k in ks:
        per_problem = [pass_at_k(num_samples, int(c), k) for c in passed_QW.sum(dim=1)]
        out[f"pass@{k}"] = sum(per_problem) / max(len(per_problem), 1)
    out["greedy_tokens_s"] = tokens_per_second(ev.greedy)
    out["sampled_tokens_s"] = tokens_per_second(ev.sampled)
    return out


def completion_records(ev: Evaluation, problems: Sequence[Problem]) -> list[dict[str, Any]]:
    """Every completion as {problem, prompt, answer, mode, sample, completion, reward, tokens}."""
    records = []
    for mode, ro in (("greedy", ev.greedy), ("sampled", ev.sampled)):
        per_problem = ro.rewards_QW.shape[1]
        for i, (completion, reward) in enumerate(
            zip(ro.completions, ro.rewards_QW.flatten().tolist(), strict=True)
        ):
            problem = problems[i // per_problem]
            records.append(
                {
                    "problem": i // per_problem,
                    "prompt": problem.prompt,
                    "answer": problem.answer,
                    "mode": mode,
                    "sample": i % per_problem,
                    "completion": completion.text or "",
                    "reward": reward,
                    "num_tokens": len(completion.tokens),
                }
            )
    return records
