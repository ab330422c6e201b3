"""GRPO math against hand computations."""

import math

import pytest
import torch

from birkhoff.rl.advantage import group_advantages
from birkhoff.rl.loss import GRPOLossConfig, grpo_loss


def test_group_advantages_hand_example() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = group_advantages(rewards, eps=0.0 + 1e-12)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    assert torch.equal(adv[1], torch.zeros(4))  # uniform group: no signal
    raw = group_advantages(rewards, normalize_std=False)
    assert torch.allclose(raw[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_group_advantages_rejects_bad_shape() -> None:
    with pytest.raises(ValueError, match="W >= 2"):
        group_advantages(torch.ones(4, 1))


def test_grpo_loss_on_policy_equals_negative_mean_advantage() -> None:
    # At ratio 1 the surrogate is A per token: loss = -token-mean of A; the gradient wrt logp
    # is -A / num_tokens for every unmasked token.
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.3, 0.2, 0.9]], dtype=torch.float64))
    logp.requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    loss, metrics = grpo_loss(logp, logp.detach(), adv, mask, GRPOLossConfig())
    assert loss.item() == pytest.approx(-(2 * 2.0 + 3 * -1.0) / 5)
    loss.backward()
    expected = -torch.tensor([[2.0, 2.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float64) / 5
    assert torch.allclose(logp.grad, expected)
    assert metrics["clip_frac"] == 0.0 and metrics["ratio_mean"] == pytest.approx(1.0)


def test_grpo_loss_clips_outside_trust_region() -> None:
    cfg = GRPOLossConfig(clip_low=0.2, clip_high=0.2)
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.log(torch.tensor([[1.5, 0.5]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = grpo_loss(new, old, torch.tensor([1.0], dtype=torch.float64), mask, cfg)
    # positive advantage: ratio 1.5 clipped to 1.2 (no gradient), ratio 0.5 kept (min picks it)
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    loss.backward()
    assert new.grad[0, 0].item() == 0.0 and new.grad[0, 1].item() == pytest.approx(-0.5 / 2)
    assert metrics["clip_frac"] == pytest.approx(1.0)


def test_kl_term_is_zero_at_reference_and_positive_elsewhere() -> None:
    cfg = GRPOLossConfig(kl_weight=0.5)
    logp = torch.log(torch.tensor([[0.5, 0.2]], dtype=torch.float64))
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.zeros(1, dtype=torch.float64)
    _, m0 = grpo_loss(logp, logp, adv, mask, cfg, ref_logp_BT=logp)
    loss, m1 = grpo_loss(logp, logp, adv, mask, cfg, ref_logp_BT=logp + 0.3)
    assert m0["kl_ref"] == 0.0
    d = 0.3
    assert m1["kl_ref"] == pytest.approx(math.exp(d) - d - 1)
    assert loss.item() == pytest.approx(0.5 * m1["kl_ref"])
