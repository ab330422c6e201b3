"""train_step with MoE layers: router biases move after an applied step; the load is logged."""

import torch
from torch import Tensor

from birkhoff.config import ModelConfig, MoEConfig
from birkhoff.model import Transformer
from birkhoff.model.moe import MoEFeedForward, load_metrics
from birkhoff.tasks.batches import build_supervised_batch
from birkhoff.tasks.problems import AdditionTask, sample_problems, step_rng
from birkhoff.tokenizer import CharTokenizer
from birkhoff.train import TrainConfig, build_optimizer, train_step

MOE = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=16, bias_update_rate=0.01)
CFG = TrainConfig(lr=1e-2, warmup_steps=0, num_steps=10)


def model_and_batch(moe: MoEConfig | None = MOE) -> tuple[Transformer, object]:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=CharTokenizer().vocab_size, dim=32, num_layers=2, num_heads=2,
                      num_streams=2, mtp_depth=1, max_seq_len=32, moe=moe)  # fmt: skip
    problems = sample_problems(AdditionTask(2), step_rng(0, 0), 8)
    return Transformer(cfg), build_supervised_batch(problems, CharTokenizer())


def layers(model: Transformer) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def test_bias_moves_after_the_step_from_the_load_the_step_logged() -> None:
    model, batch = model_and_batch()
    opt = build_optimizer(model, CFG)
    metrics = train_step(model, opt, batch, CFG, step=0)
    tokens = batch.input_ids.numel()  # type: ignore[attr-defined]
    for layer in layers(model):  # zero bias before: exactly one update of -gamma * sign
        load_E: Tensor = layer.expert_load
        expected = -0.01 * torch.sign(load_E - load_E.mean())
        assert torch.equal(layer.router_bias, expected) and layer.router_bias.abs().sum() > 0
        assert float(load_E.sum()) == tokens * 2
    assert metrics["moe_mean_load"] == tokens * 2 / 4
    assert metrics == metrics | load_metrics(model)  # what the step logged is the load it saw
    assert metrics["moe_max_over_mean"] == max(
        float(m.expert_load.max() / m.expert_load.mean()) for m in layers(model)
    )


def test_a_skipped_step_leaves_the_bias_alone_and_dense_models_log_no_load() -> None:
    model, batch = model_and_batch()
    opt = build_optimizer(model, CFG)
    with torch.no_grad():
        model.embed.weight[0, 0] = float("nan")  # non-finite gradient norm: step skipped
    metrics = train_step(model, opt, batch, CFG, step=0)
    assert metrics["skipped"] == 1.0
    assert all(layer.router_bias.abs().sum() == 0 for layer in layers(model))
    dense, batch = model_and_batch(None)
    metrics = train_step(dense, build_optimizer(dense, CFG), batch, CFG, step=0)
    assert not any(k.startswith("moe_") for k in metrics) and load_metrics(dense) == {}
