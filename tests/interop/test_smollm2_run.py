"""smollm2-grpo on CPU: the preset's model is SmolLM2's, one GRPO step on the session's dense
import, and the whole preset shrunk to tiny sizes from the GGUF (import, MTP self-distillation,
GRPO, evaluation, checkpoint, plot). Apart from test_smollm2.py so that module's inference
models are freed before these train.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from smollm2 import imported_dirs

from birkhoff.presets import Preset, get_preset
from birkhoff.rl.inputs import checkpoint_config, run_inputs
from birkhoff.rl.loop import GRPORun


@pytest.fixture(scope="session")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return imported_dirs(tmp_path_factory)


SHRUNK = {  # smollm2-grpo at tiny sizes, on CPU
    "train.amp_dtype": "none",
    "train.batch_size": 2,
    "model.max_seq_len": 128,
    "rl.num_prompts": 2,
    "rl.group_size": 2,
    "rl.max_new_tokens": 8,
    "rl.num_eval_prompts": 2,
    "rl.eval_every": 1,
    "rl.checkpoint_every": 0,
    "rl.warmup_steps": 1,
    "rl.num_steps": 1,
}


def shrunk(preset: Preset) -> Preset:
    from birkhoff.overrides import Override, apply

    return apply(preset, [Override(k, str(v), k) for k, v in SHRUNK.items()])


def test_preset_model_is_the_imported_one(dirs: dict[str, Path]) -> None:
    for name, variant in (("smollm2-grpo", "upcycled"), ("smollm2-grpo-dense", "dense")):
        model = get_preset(name).model
        assert model == checkpoint_config(dirs[variant]).replace(max_seq_len=model.max_seq_len)


def test_one_grpo_step_on_the_dense_import(dirs: dict[str, Path], tmp_path: Path) -> None:
    """The dense twin from the session's import: the chat-templated task, one GRPO step."""
    preset = shrunk(get_preset("smollm2-grpo-dense"))
    assert preset.rl is not None
    preset = preset.replace(init=str(dirs["dense"]), rl=preset.rl.replace(warmup_steps=0))
    preset, inputs = run_inputs(preset, out=tmp_path)
    assert inputs["init"] == dirs["dense"] and inputs["tokenizer"].chat
    rows = GRPORun(preset, tmp_path, device="cpu", **inputs).run(progress=False)
    assert [(r["phase"], r["step"]) for r in rows] == [("eval", 0), ("grpo", 0), ("eval", 1)]
    grpo = rows[1]
    assert math.isfinite(grpo["policy_loss"]) and grpo["weight_version"] == 1
    assert 0 <= grpo["reward"] <= 1


@pytest.mark.slow
def test_smollm2_grpo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`birkhoff run --preset smollm2-grpo` shrunk: the GGUF imported into OUT/init (S=4, M=1),
    one MTP self-distillation step, one GRPO step, evaluations, checkpoint, plot."""
    from birkhoff.cli import main

    out = tmp_path / "s"
    settings = [arg for k, v in SHRUNK.items() for arg in ("--set", f"{k}={v}")]
    argv = ["run", "--preset", "smollm2-grpo", "--device", "cpu", "--out", str(out)]
    argv += ["--no-progress", *settings]
    assert main(argv) == 0
    assert "eval_reward" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["mtp", "eval", "grpo", "eval"]
    assert rows[0]["mtp_loss"] > 0 and "eval_accept_1" in rows[1]
    cfg = checkpoint_config(out / "init")
    assert (cfg.num_streams, cfg.mtp_depth, cfg.max_seq_len) == (4, 1, 128)
    assert (out / "checkpoint").is_dir() and (out / "plots.png").is_file()
