"""RLConfig and GRPOLossConfig reject bad values, naming the field and the value."""

import pytest

from birkhoff.rl.config import RLConfig
from birkhoff.rl.loss import GRPOLossConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("group_size", 1),
        ("num_prompts", 0),
        ("temperature", 0.0),
        ("max_new_tokens", 0),
        ("updates_per_step", 0),
        ("max_staleness", -1),
        ("mtp_loss_weight", -0.1),
        ("lr", float("inf")),
        ("refit_quantize", "int4"),
    ],
)
def test_rl_config_rejects(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as err:
        RLConfig(**{field: value})  # type: ignore[arg-type]
    assert repr(value) in str(err.value)


@pytest.mark.parametrize(("field", "value"), [("clip_low", 1.0), ("kl_weight", -1.0)])
def test_loss_config_rejects(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        GRPOLossConfig(**{field: value})  # type: ignore[arg-type]
