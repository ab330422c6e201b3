"""smollm2-grpo on CPU: the preset's model is SmolLM2's, one GRPO step on the session's dense
import, the preset's import of its GGUF into OUT/init (and its reuse), and the whole preset
shrunk to tiny sizes from the session's upcycled import (MTP self-distillation, GRPO,
evaluation, checkpoint, plot). Apart from test_smollm2.py so that module's inference models are
freed before these train.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from smollm2 import MAX_SEQ_LEN, gguf_path, imported_dirs

from birkhoff.presets import Preset, get_preset
from birkhoff.rl.inputs import INIT_DIR, checkpoint_config, preset_init, run_inputs
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


def test_preset_init_imports_the_gguf_into_out_init(
    dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """smollm2-grpo's `init` (the wheel's GGUF) is imported into OUT/init at the preset's S=4,
    M=1 and max_seq_len; an import there with those settings is reused, one with others is
    not (the import itself: the session's `birkhoff import-hf` of the same file)."""
    from birkhoff.interop import gguf

    calls: list[tuple[Path, Path, dict[str, int]]] = []

    def record(source: Path, target: Path, **shape: int) -> Path:
        calls.append((source, target, shape))
        return target

    monkeypatch.setattr(gguf, "import_gguf", record)
    target = tmp_path / INIT_DIR
    preset = shrunk(get_preset("smollm2-grpo"))
    assert preset_init(preset, tmp_path) == target
    assert calls == [(gguf_path(), target, dict(num_streams=4, mtp_depth=1, max_seq_len=128))]
    target.symlink_to(dirs["upcycled"], target_is_directory=True)  # S=4, M=1, MAX_SEQ_LEN
    full = preset.replace(model=preset.model.replace(max_seq_len=MAX_SEQ_LEN))
    assert preset_init(full, tmp_path) == target and len(calls) == 1
    assert preset_init(preset, tmp_path) == target and len(calls) == 2


@pytest.mark.slow
def test_smollm2_grpo_runs_end_to_end(
    dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`birkhoff run --preset smollm2-grpo` shrunk: the GGUF's import in OUT/init (S=4, M=1:
    the session's, which the run reuses rather than importing again), one MTP
    self-distillation step, one GRPO step, evaluations, checkpoint, plot."""
    from birkhoff.cli import main

    out = tmp_path / "s"
    out.mkdir()
    (out / INIT_DIR).symlink_to(dirs["upcycled"], target_is_directory=True)
    shrunk_full = {**SHRUNK, "model.max_seq_len": MAX_SEQ_LEN}  # the session import's
    settings = [arg for k, v in shrunk_full.items() for arg in ("--set", f"{k}={v}")]
    argv = ["run", "--preset", "smollm2-grpo", "--device", "cpu", "--out", str(out)]
    argv += ["--no-progress", *settings]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "eval_reward" in printed and "importing" not in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["mtp", "eval", "grpo", "eval"]
    assert rows[0]["mtp_loss"] > 0 and "eval_accept_1" in rows[1]
    cfg = checkpoint_config(out / "init")
    assert (cfg.num_streams, cfg.mtp_depth, cfg.max_seq_len) == (4, 1, MAX_SEQ_LEN)
    assert (out / "checkpoint").is_dir() and (out / "plots.png").is_file()
