"""Rollout batches: token alignment with the engine's logprobs, staleness bound."""

import pytest
import torch

from birkhoff.engine.decode import Completion
from birkhoff.rl.rollout import Rollout, StaleRolloutError, build_rl_batch, check_staleness


def test_build_rl_batch_aligns_completion_tokens_and_logprobs() -> None:
    prompts = [[1, 5, 6], [1, 7]]
    completions = [
        Completion([8, 2], [-0.5, -0.1], 3, "stop"),
        Completion([9, 9, 2], [-1.0, -2.0, -0.3], 3, "stop"),
    ]
    ro = Rollout(prompts, completions, torch.zeros(1, 2), [], 0, 0.0)
    batch = build_rl_batch(ro, torch.tensor([[1.0, -1.0]]), pad_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 9, 2]]
    assert batch.completion_mask.tolist() == [
        [False, False, False, True, True],
        [False, False, True, True, True],
    ]
    expected = torch.tensor([[0, 0, 0, -0.5, -0.1], [0, 0, -1.0, -2.0, -0.3]])
    assert torch.equal(batch.rollout_logp, expected)
    assert batch.advantages.tolist() == [1.0, -1.0]
    assert batch.weight_versions == [3, 3]


def test_staleness_bound() -> None:
    check_staleness([4, 5], trainer_version=6, max_staleness=2)
    with pytest.raises(StaleRolloutError, match="weight_version 4 are 3 updates behind"):
        check_staleness([4, 5], trainer_version=7, max_staleness=2)
