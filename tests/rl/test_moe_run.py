"""The MoE presets: the main job runs with MoE layers and logs the expert load every step."""

from pathlib import Path

import pytest
import torch

from birkhoff.model.moe import MoEFeedForward
from birkhoff.presets import get_preset
from birkhoff.rl.loop import GRPORun
from birkhoff.runtime.plots import MOE_PANEL, PANELS, plot_run

MOE_KEYS = ("moe_max_load", "moe_mean_load", "moe_max_over_mean", "moe_rerouted_fraction",
            "moe_balance_loss")  # fmt: skip


def test_tiny_moe_run_logs_expert_load_refits_and_plots(tmp_path: Path) -> None:
    preset = get_preset("tiny-cpu-moe")
    assert preset.rl is not None and preset.model.moe is not None
    rl = preset.rl.replace(warmup_steps=3, num_steps=3, num_prompts=4, group_size=4,
                           num_eval_prompts=8, eval_every=3, checkpoint_every=0)  # fmt: skip
    run = GRPORun(preset.replace(rl=rl), tmp_path, device="cpu")
    rows = run.run(progress=False)
    trained = [r for r in rows if r["phase"] in ("sft", "grpo")]
    assert {r["phase"] for r in trained} == {"sft", "grpo"}
    for r in trained:
        assert all(k in r for k in MOE_KEYS), r
        assert r["moe_max_load"] >= r["moe_mean_load"] > 0 and r["moe_max_over_mean"] >= 1
        assert 0 <= r["moe_rerouted_fraction"] <= 1
    assert any(r["moe_rerouted_fraction"] > 0 for r in trained[1:])  # the bias moved
    grpo = [r for r in rows if r["phase"] == "grpo"]
    assert [r["weight_version"] for r in grpo] == [2, 3, 4]  # one MoE refit per step
    layers = [m for m in run.model.modules() if isinstance(m, MoEFeedForward)]
    assert len(layers) == 2 and all(m.router_bias.abs().sum() > 0 for m in layers)
    bias = layers[0].router_bias
    served = run.engine.weights["layers.1.mlp.router_bias"]
    assert torch.equal(served, bias) and served.dtype == torch.float32
    png = plot_run(tmp_path / "metrics.jsonl", tmp_path / "plots.png").read_bytes()
    height = int.from_bytes(png[20:24], "big")  # PNG IHDR: width, then height
    assert MOE_PANEL not in PANELS and height == round(2.6 * (len(PANELS) + 1) * 90)


@pytest.mark.parametrize("name", ["tiny-cpu-moe", "h200-grpo-moe"])
def test_moe_presets_match_the_dense_active_width(name: str) -> None:
    preset = get_preset(name)
    dense = get_preset(name.removesuffix("-moe")).model
    moe = preset.model.moe
    assert moe is not None and preset.model.replace(moe=None) == dense
    active = (moe.experts_per_token + moe.num_shared_experts) * moe.expert_hidden
    assert abs(active - dense.ffn_dim) <= 0.1 * dense.ffn_dim
