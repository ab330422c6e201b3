"""Rollouts: sample W completions per prompt from the engine, score them, build the train batch.

Legend: Q prompts, W group size, B = Q*W completions, T tokens.

The batch keeps the engine's per-token logprobs (the behaviour policy, sampled at temperature
`RLConfig.temperature` with no top-k/top-p, so they are the policy's own logprobs at T=1) and the
`weight_version` of every completion; the trainer checks staleness against them before each
update. Generation stops at the tokenizer's stop ids and the task's stop strings (`Task.stop`);
the reward scores the completion's text (ending with its stop string, engine/stop.py); a
guarded user verifier's errors and timeouts during the rollout are counted (`verifier_counts`).
Token positions follow the label convention of model/mtp.py: `completion_mask[j]` and
`rollout_logp[j]` describe token j, which the model predicts at position j-1.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from birkhoff.engine import Engine, SamplingParams
from birkhoff.engine.decode import Completion
from birkhoff.engine.stop import Detokenize
from birkhoff.rl.config import RLConfig
from birkhoff.tasks.batches import prompt_ids
from birkhoff.tasks.problems import Problem, Task
from birkhoff.tokenizer import Tokenizer


class StaleRolloutError(ValueError):
    """Completions were produced by weights older than the configured staleness bound."""


class Rollout(NamedTuple):
    prompts: list[list[int]]  # B = Q*W, each problem's prompt repeated W times (grouped)
    completions: list[Completion]
    rewards_QW: Tensor
    accepted_at: list[int]  # per draft position: verify steps that accepted it
    num_verify_steps: int
    seconds: float
    verifier_counts: tuple[tuple[str, int], ...] = ()  # this rollout's verifier failures

    @property
    def acceptance(self) -> list[float]:
        return [n / max(self.num_verify_steps, 1) for n in self.accepted_at]


class RLBatch(NamedTuple):
    input_ids: Tensor  # [B,T] framed prompt + completion, right-padded
    completion_mask: Tensor  # [B,T] True on completion tokens
    rollout_logp: Tensor  # [B,T] engine logprob of token j (0 off the completion)
    advantages: Tensor  # [B]
    weight_versions: list[int]

    def to(self, device: torch.device | str) -> RLBatch:
        return RLBatch(
            self.input_ids.to(device),
            self.completion_mask.to(device),
            self.rollout_logp.to(device),
            self.advantages.to(device),
            self.weight_versions,
        )


def generate_batched(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    detokenize: Detokenize | None = None,
) -> tuple[list[Completion], list[int], int]:
    """One engine.generate over all prompts (continuous batching fills max_batch_size rows);
    (completions, accepted_at, verify steps)."""
    completions = engine.generate(prompts, params, detokenize=detokenize)
    stats = engine.last_stats
    if stats is None:
        return completions, [0] * params.num_speculative_tokens, 0
    return completions, list(stats.accepted_at), stats.num_steps


def rollout(
    engine: Engine,
    problems: Sequence[Problem],
    task: Task,
    tokenizer: Tokenizer,
    cfg: RLConfig,
    *,
    seed: int,
    greedy: bool = False,
) -> Rollout:
    """Seeded completions scored by the task's verifiable reward.

    Default: W samples per problem at the rollout temperature (a GRPO batch, rewards [Q,W]).
    `greedy=True`: one argmax completion per problem (evaluation, rewards [Q,1]).
    """
    start = time.perf_counter()
    per_problem = 1 if greedy else cfg.group_size
    grouped = [p for p in problems for _ in range(per_problem)]
    prompts = [prompt_ids(p, tokenizer) for p in grouped]
    params = SamplingParams(
        cfg.max_new_tokens,
        temperature=0.0 if greedy else cfg.temperature,
        stop_token_ids=tokenizer.stop_ids,
        stop=getattr(task, "stop", ()),  # user tasks may predate stop strings
        seed=seed,
        num_speculative_tokens=cfg.num_speculative_tokens,
    )
    completions, accepted_at, num_steps = generate_batched(
        engine, prompts, params, tokenizer.decode
    )
    before = task_counts(task)
    rewards = [task.reward(p, c.text or "") for p, c in zip(grouped, completions, strict=True)]
    counts = tuple((k, v - before[k]) for k, v in task_counts(task).items())
    rewards_QW = torch.tensor(rewards, dtype=torch.float32).view(len(problems), per_problem)
    seconds = time.perf_counter() - start
    return Rollout(prompts, completions, rewards_QW, accepted_at, num_steps, seconds, counts)


def task_counts(task: Task) -> dict[str, int]:
    """A task's verifier calls / errors / timeouts so far, for tasks scored by a guarded user
    verifier (tasks/guard.py: `counts()`), else {}."""
    counts = getattr(task, "counts", None)
    return {} if counts is None else dict(counts())


def build_rl_batch(rollout: Rollout, advantages_QW: Tensor, *, pad_id: int) -> RLBatch:
    """Right-padded [B,T] prompt+completion ids with the completion mask and rollout logprobs."""
    rows = [p + c.tokens for p, c in zip(rollout.prompts, rollout.completions, strict=True)]
    T = max(len(r) for r in rows)
    B = len(rows)
    ids_BT = torch.full((B, T), pad_id, dtype=torch.int64)
    mask_BT = torch.zeros((B, T), dtype=torch.bool)
    logp_BT = torch.zeros((B, T), dtype=torch.float32)
    for b, (prompt, comp) in enumerate(zip(rollout.prompts, rollout.completions, strict=True)):
        lo, hi = len(prompt), len(prompt) + len(comp.tokens)
        ids_BT[b, :hi] = torch.tensor(prompt + comp.tokens)
        mask_BT[b, lo:hi] = True
        logp_BT[b, lo:hi] = torch.tensor(comp.logprobs, dtype=torch.float32)
    versions = [c.weight_version for c in rollout.completions]
    return RLBatch(ids_BT, mask_BT, logp_BT, advantages_QW.flatten().float(), versions)


def check_staleness(versions: Sequence[int], trainer_version: int, max_staleness: int) -> None:
    """Refuse completions more than `max_staleness` updates behind the trainer's weights."""
    oldest = min(versions)
    if trainer_version - oldest > max_staleness:
        raise StaleRolloutError(
            f"completions from weight_version {oldest} are {trainer_version - oldest} updates "
            f"behind the trainer (version {trainer_version}); max_staleness={max_staleness}"
        )
