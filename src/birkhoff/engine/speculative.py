"""Speculative decoding: exact acceptance of MTP drafts, and its statistics.

Legend: A active rows, J drafts per step, T = J+1 verified positions, V vocab.

Depth k drafts t_{i+k+1} exactly as the MTP depths are trained (drafts beyond M reuse the last
depth). `accept_drafts` (Leviathan et al. / Chen et al.) accepts draft x_j with probability
min(1, p_j(x)/q_j(x)) left to right, samples from norm(max(0, p_j - q_j)) at the first rejection
and a bonus token from p_J if all are accepted, so every emitted token is distributed exactly as
p; for greedy rows it is argmax agreement. step.py runs drafting, verification and this
acceptance as one device step. The derivation: docs/engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from birkhoff.engine.sampling import sample_inverse_cdf


def accept_drafts(
    p_ATV: Tensor, q_AJV: Tensor, drafts_AJ: Tensor, u_AJ: Tensor, u_A: Tensor
) -> tuple[Tensor, Tensor]:
    """(number of accepted drafts [A], the next token [A]) by exact rejection sampling.

    p_ATV: target probabilities at the T = J+1 verified positions;
    q_AJV: draft probabilities; drafts_AJ: the drafted tokens (sampled from q);
    u_AJ: uniforms of the acceptance tests; u_A: the uniform that samples the next token.
    """
    A, J = drafts_AJ.shape
    p_draft_AJ = p_ATV[:, :J].gather(-1, drafts_AJ[..., None]).squeeze(-1)
    q_draft_AJ = q_AJV.gather(-1, drafts_AJ[..., None]).squeeze(-1)
    ok_AJ = u_AJ * q_draft_AJ < p_draft_AJ  # u < p/q without dividing; q(x) > 0 as x ~ q
    num_accepted_A = ok_AJ.long().cumprod(dim=1).sum(dim=1)
    rows_A = torch.arange(A, device=p_ATV.device)
    p_next_AV = p_ATV[rows_A, num_accepted_A]
    # q is zero past the last draft, so with everything accepted the residual is p_J itself
    q_padded_ATV = torch.cat((q_AJV, torch.zeros_like(q_AJV[:, :1])), dim=1)
    residual_AV = (p_next_AV - q_padded_ATV[rows_A, num_accepted_A]).clamp_min(0)
    # rounding can empty the residual where p ~ q (then rejection had ~zero probability)
    empty_A1 = residual_AV.sum(dim=-1, keepdim=True) <= 0
    residual_AV = torch.where(empty_A1, p_next_AV, residual_AV)
    return num_accepted_A, sample_inverse_cdf(residual_AV, u_A)


@dataclass(slots=True)
class SpecStats:
    """Acceptance statistics of one generate call (counted per row and verify step)."""

    num_drafts: int
    num_steps: int = 0  # verify steps, summed over rows
    num_emitted: int = 0  # tokens produced by verify steps (accepted drafts + 1 each)
    accepted_at: list[int] = field(default_factory=list)  # per draft position j: steps accepting j

    def __post_init__(self) -> None:
        if not self.accepted_at:
            self.accepted_at = [0] * self.num_drafts

    def record(self, num_accepted: list[int]) -> None:
        for a in num_accepted:
            self.num_steps += 1
            self.num_emitted += a + 1
            for j in range(a):
                self.accepted_at[j] += 1

    @property
    def acceptance_rate(self) -> list[float]:
        """Per draft position j (1-based in prose): P(drafts 1..j all accepted) per step."""
        return [n / max(self.num_steps, 1) for n in self.accepted_at]

    @property
    def conditional_acceptance_rate(self) -> list[float]:
        """P(draft j accepted | drafts 1..j-1 accepted)."""
        reached = [self.num_steps, *self.accepted_at[:-1]]
        return [n / max(r, 1) for n, r in zip(self.accepted_at, reached, strict=True)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the corrected/bonus token)."""
        return self.num_emitted / max(self.num_steps, 1)
