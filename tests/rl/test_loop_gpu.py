"""The GRPO loop on CUDA: bf16 autocast training, bf16 engine, refit per step (marked gpu)."""

from pathlib import Path

import pytest
import torch

from birkhoff.presets import tiny_cpu
from birkhoff.rl.loop import GRPORun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_grpo_loop_on_cuda(tmp_path: Path) -> None:
    preset = tiny_cpu()
    assert preset.rl is not None
    rl = preset.rl.replace(
        warmup_steps=3,
        num_steps=3,
        num_prompts=4,
        group_size=4,
        num_eval_prompts=8,
        eval_every=3,
        checkpoint_every=0,
    )
    preset = preset.replace(train=preset.train.replace(amp_dtype="bf16"), rl=rl)
    run = GRPORun(preset, tmp_path, device="cuda")
    assert run.engine.dtype == torch.bfloat16
    rows = run.run(progress=False)
    grpo = [r for r in rows if r["phase"] == "grpo"]
    assert [r["weight_version"] for r in grpo] == [2, 3, 4]
    assert all(r["mem_peak_mib"] > 0 for r in grpo)
    # bf16 engine vs fp32 trainer weights under autocast: ratios stay near 1
    assert all(abs(r["ratio_mean"] - 1.0) < 0.1 for r in grpo)
