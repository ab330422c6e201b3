import math

import pytest
import torch

from birkhoff.config import ModelConfig
from birkhoff.model import Transformer
from birkhoff.train import TrainConfig, build_optimizer, lr_at
from birkhoff.train.optim import split_decay_params

MATMUL = ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w_gate.weight", "w_up.weight",
          "w_down.weight", "proj.weight")  # fmt: skip


def model(**kw) -> Transformer:
    cfg = dict(vocab_size=20, dim=16, num_layers=2, num_heads=2, num_streams=3, mtp_depth=1)
    return Transformer(ModelConfig(**(cfg | kw)))


@pytest.mark.parametrize("tie", [False, True])
def test_decay_split_by_module_type(tie):
    m = model(tie_embeddings=tie)
    decay, no_decay = split_decay_params(m)
    name_of = {id(p): n for n, p in m.named_parameters()}
    decay_names = {name_of[id(p)] for p in decay}
    no_decay_names = {name_of[id(p)] for p in no_decay}
    expected = {n for n, _ in m.named_parameters() if n.endswith(MATMUL)} | {"embed.weight"}
    if not tie:
        expected.add("lm_head.weight")
    assert decay_names == expected
    assert "layers.0.hc_attn.phi" in no_decay_names and "layers.1.hc_mlp.bias" in no_decay_names
    assert "contraction.alpha" in no_decay_names and "mtp.0.contraction.phi" in no_decay_names
    assert all(n.endswith(("norm.weight", ".phi", ".alpha", ".bias")) for n in no_decay_names)
    assert len(decay) + len(no_decay) == len(list(m.parameters()))  # each parameter once


def test_optimizer_groups_carry_the_decay():
    m = model()
    cfg = TrainConfig(weight_decay=0.05, betas=(0.8, 0.9))
    opt = build_optimizer(m, cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)


def test_no_decay_params_are_not_decayed():
    """With zero gradients AdamW changes only decayed weights (by lr * wd * w)."""
    m = model()
    cfg = TrainConfig(lr=0.1, weight_decay=0.5)
    opt = build_optimizer(m, cfg)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in m.named_parameters():
        if n.endswith(MATMUL):
            torch.testing.assert_close(p, before[n] * (1 - 0.1 * 0.5))
        elif n.endswith(("phi", "alpha", "bias", "norm.weight")):
            assert torch.equal(p, before[n]), n


def test_lr_schedule():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, num_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # cosine midpoint
    assert lr_at(110, cfg) == pytest.approx(0.1) and lr_at(500, cfg) == pytest.approx(0.1)
    values = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert lr_at(0, cfg.replace(warmup_steps=0)) == 1.0


@pytest.mark.parametrize(
    "field,value",
    [("lr", 0.0), ("lr", math.nan), ("weight_decay", -1.0), ("betas", (0.9, 1.0)),
     ("num_steps", 0), ("batch_size", 0), ("amp_dtype", "fp16"), ("min_lr_ratio", 2.0),
     ("warmup_steps", -1), ("grad_clip", math.inf)],
)  # fmt: skip
def test_train_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})
