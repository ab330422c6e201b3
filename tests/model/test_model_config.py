import pytest

from birkhoff.config import ModelConfig

BASE = dict(vocab_size=32, dim=64, num_layers=2, num_heads=4)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vocab_size", 0),
        ("dim", 63),
        ("num_heads", 0),
        ("num_kv_heads", 3),
        ("num_streams", 0),
        ("sinkhorn_iters", 0),
        ("mtp_depth", -1),
        ("mtp_loss_weight", float("nan")),
        ("norm_eps", 0.0),
    ],
)
def test_invalid_field_names_field_and_value(field: str, value: object) -> None:
    kwargs = {**BASE, field: value}
    with pytest.raises(ValueError, match=field) as err:
        ModelConfig(**kwargs)  # type: ignore[arg-type]
    assert repr(value) in str(err.value)


def test_derived_fields_and_json_round_trip() -> None:
    import json

    cfg = ModelConfig(**BASE, num_kv_heads=2)
    assert (cfg.head_dim, cfg.kv_heads, cfg.ffn_dim) == (16, 2, 176)
    assert ModelConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(ValueError, match="unknown field"):
        ModelConfig.from_dict({**BASE, "colour": 1})


def test_a_config_saved_with_the_retired_kernel_field_still_loads() -> None:
    """The kernel choice is a runtime option now (TrainConfig.kernels, Engine(kernels=...));
    model configs written before hold `mhc_kernels`, which loading drops."""
    from birkhoff.train.config import TrainConfig

    assert ModelConfig.from_dict({**BASE, "mhc_kernels": "eager"}) == ModelConfig(**BASE)  # type: ignore[arg-type]
    assert "mhc_kernels" not in ModelConfig(**BASE).to_json()  # type: ignore[arg-type]
    assert TrainConfig(kernels="eager").kernels == "eager"
    with pytest.raises(ValueError, match="kernels='cuda'"):
        TrainConfig(kernels="cuda")  # type: ignore[arg-type]
