"""The DeepSeek-V4 preset through the whole loop on CPU: warm-up, GRPO with the engine decoding
V4 (compressed caches, hash-routed MoE, MTP drafts), a refit of every V4 tensor per step."""

from pathlib import Path

import torch

from birkhoff.presets import get_preset
from birkhoff.rl.loop import GRPORun


def test_tiny_v4_grpo_run_decodes_and_refits_every_step(tmp_path: Path) -> None:
    preset = get_preset("tiny-cpu-v4")
    assert preset.rl is not None and preset.model.attention is not None
    rl = preset.rl.replace(warmup_steps=2, num_steps=3, num_prompts=4, group_size=4,
                           num_eval_prompts=8, eval_every=3, checkpoint_every=0)  # fmt: skip
    run = GRPORun(preset.replace(rl=rl), tmp_path, device="cpu")
    rows = run.run(progress=False)
    grpo = [r for r in rows if r["phase"] == "grpo"]
    assert [r["weight_version"] for r in grpo] == [2, 3, 4]  # one V4 refit per step
    assert all(torch.isfinite(torch.tensor(float(r["loss"]))) for r in grpo)
    served = run.engine.weights
    indexer = "layers.0.attn.compressor.indexer.kv_gate.weight"
    parts = [run.model.get_parameter(f"layers.0.attn.compressor.indexer.{p}_proj.weight")
             for p in ("kv", "gate")]  # fmt: skip
    assert torch.equal(served[indexer], torch.cat(parts).to(served[indexer].dtype))
    assert torch.equal(served["layers.0.mlp.tid2eid"], run.model.get_buffer("layers.0.mlp.tid2eid"))
