"""Rollout figures of a step over every rank: reward, its spread, MTP acceptance, tokens/s.

Legend: Q prompts, W group size.

In one process they are the rollout's own figures (mean reward, population std, accepted drafts
per verify step). Over several ranks each rank generated its share of the prompts; the sums
(reward, squared reward, count, accepted drafts per position, verify steps) are all-reduced in
one float64 tensor and the same figures are formed from them, so they describe the global batch.
Seconds are the slowest rank's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from birkhoff.rl.rollout import Rollout
from birkhoff.runtime.distributed import world_size


def rollout_metrics(ro: Rollout, device: torch.device) -> dict[str, float]:
    """{"reward", "reward_std", "accept_<j>", "generate_s", "completion_tokens" (mean a
    completion), "rollout_tok_s" (completion tokens a second)} of the global batch, and the
    verifier's calls / errors / timeouts when a guarded user verifier scored it."""
    counts = dict(ro.verifier_counts)
    num_tokens = float(sum(len(c.tokens) for c in ro.completions))
    if world_size() == 1:
        out = {
            "reward": float(ro.rewards_QW.mean()),
            "reward_std": float(ro.rewards_QW.std(correction=0)),
        }
        out.update({f"accept_{j + 1}": a for j, a in enumerate(ro.acceptance)})
        out.update(token_rates(num_tokens, float(ro.rewards_QW.numel()), ro.seconds))
        return out | {k: float(v) for k, v in counts.items()} | {"generate_s": ro.seconds}
    rewards_QW = ro.rewards_QW.double()
    sums = [
        float(rewards_QW.sum()),
        float((rewards_QW**2).sum()),
        float(rewards_QW.numel()),
        float(ro.num_verify_steps),
        num_tokens,
    ]
    extra = [float(a) for a in ro.accepted_at] + [float(v) for v in counts.values()]
    t = torch.tensor(sums + extra, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    seconds = torch.tensor([ro.seconds], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    total, squares, count, steps, tokens, *rest = t.tolist()
    accepted, summed = rest[: len(ro.accepted_at)], rest[len(ro.accepted_at) :]
    mean = total / max(count, 1.0)
    out = {"reward": mean, "reward_std": math.sqrt(max(squares / max(count, 1.0) - mean**2, 0.0))}
    out.update({f"accept_{j + 1}": a / max(steps, 1.0) for j, a in enumerate(accepted)})
    out.update(zip(counts, summed, strict=True))
    out.update(token_rates(tokens, count, float(seconds.item())))
    return out | {"generate_s": float(seconds.item())}


def token_rates(num_tokens: float, num_completions: float, seconds: float) -> dict[str, float]:
    """Mean completion length and completion tokens a second of one step's rollouts."""
    return {
        "completion_tokens": num_tokens / max(num_completions, 1.0),
        "rollout_tok_s": num_tokens / seconds if seconds > 0 else 0.0,
    }
