"""A run's settings from the command line and TOML files: `--set`, `--PATH VALUE`, `--config`,
`birkhoff presets`, errors in the user's words, `--help` defaults, `--version`, and what
`--resume` accepts or refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from birkhoff.cli import main
from birkhoff.cli.common import UsageError
from birkhoff.cli.resume import resume_notes
from birkhoff.overrides import as_settings
from birkhoff.presets import PRESETS, get_preset, tiny_cpu


def resolved(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["presets", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_presets_toml_reads_back_into_the_same_preset(tmp_path, capsys, name: str) -> None:
    """`birkhoff presets NAME` > FILE; `--config FILE` on the default preset gives NAME again
    (every field, including the unset optional ones and the nested moe / loss tables)."""
    file = tmp_path / "run.toml"
    file.write_text(resolved(capsys, name))
    again = resolved(capsys, "--config", str(file))  # on top of tiny-cpu
    assert again == file.read_text()
    from birkhoff.cli.config import preset_from_args

    class Args:
        config, overrides, dotted = file, [], []

    assert preset_from_args(Args(), "tiny-cpu") == get_preset(name)  # type: ignore[arg-type]


def test_presets_lists_one_line_each(capsys) -> None:
    lines = resolved(capsys).splitlines()
    assert [line.split()[0] for line in lines] == list(PRESETS)
    assert "MoE 4 experts top-2" in lines[list(PRESETS).index("tiny-cpu-moe")]


def test_set_and_dotted_flags_and_their_order(tmp_path, capsys) -> None:
    file = tmp_path / "part.toml"
    file.write_text("[rl]\nlr = 0.5\nnum_steps = 9\n[train]\nbetas = [0.8, 0.9]\n")
    out = resolved(
        capsys,
        "tiny-cpu",
        "--config",
        str(file),
        "--set",
        "rl.lr=1e-4",
        "--rl.group_size",
        "4",
        "--train.compile=false",
        "--set",
        "model.moe.num_experts=4",
        "--model.moe.experts_per_token",
        "2",
        "--set",
        "model.moe.expert_hidden=32",
        "--task_options.num_digits",
        "2",
        "--set",
        "rl.refit_quantize=fp8",
    )
    import tomllib

    data = tomllib.loads(out)
    assert data["rl"]["lr"] == 1e-4 and data["rl"]["num_steps"] == 9  # the flag beats the file
    assert data["rl"]["group_size"] == 4 and data["train"]["betas"] == [0.8, 0.9]
    assert data["model"]["moe"]["num_experts"] == 4 and data["model"]["moe"]["expert_hidden"] == 32
    assert data["task_options"] == {"num_digits": 2} and data["rl"]["refit_quantize"] == "fp8"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-new-tokens", "-5"], "--max-new-tokens -5 is invalid: must be an int >= 1"),
        (["--steps", "-1"], "--steps -1 is invalid: must be an int >= 0"),
        (["--set", "rl.lr=-1"], "--set rl.lr=-1 is invalid: must be finite and > 0"),
        (["--rl.group_size", "1"], "--rl.group_size 1 is invalid: must be >= 2"),
        (["--set", "rl.lr=abc"], "--set rl.lr=abc: expected a number"),
        (["--set", "rl.lrr=1"], "unknown setting 'rl.lrr'; did you mean rl.lr"),
        (["--set", "rl.lr"], "--set rl.lr: expected PATH=VALUE"),
        (["--set", "train.compile=maybe"], "expected true or false"),
        (
            ["--set", "model.num_heads=5"],
            "must divide by num_heads (or set attn_head_dim) (with --set model.num_heads=5)",
        ),
        (["--set", "model.moe.num_experts=4"], "model.moe also needs model.moe.experts_per_token"),
        (["--resume", "--overwrite"], "--resume continues the run in --out, --overwrite"),
    ],
)
def test_bad_settings_are_named_as_the_user_wrote_them(tmp_path, capsys, args, message) -> None:
    assert main(["run", "--out", str(tmp_path / "r"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_bad_toml_names_the_file_and_setting(tmp_path, capsys) -> None:
    file = tmp_path / "run.toml"
    file.write_text("[rl]\nmax_new_tokens = 0\n")
    assert main(["run", "--out", str(tmp_path / "r"), "--config", str(file)]) == 2
    assert (
        f"{file}: rl.max_new_tokens = 0 is invalid: must be an int >= 1" in capsys.readouterr().err
    )
    file.write_text("[rl\n")
    assert main(["run", "--out", str(tmp_path / "r"), "--config", str(file)]) == 2
    assert f"--config {file}: invalid TOML" in capsys.readouterr().err


def test_dotted_flags_only_where_settings_are_taken(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--checkpoint", "x", "--prompt", "a", "--rl.lr", "1"])
    assert exc.value.code == 2 and "unrecognized arguments: --rl.lr 1" in capsys.readouterr().err


def test_help_shows_defaults_and_every_preset(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    unwrapped = text.replace("- ", "-")  # argparse wraps lines at hyphens (tiny-|cpu-v4)
    assert all(name in unwrapped for name in PRESETS)
    assert (
        "(default: tiny-cpu)" in text
        and "rl.num_steps (GRPO steps) (default: the preset's; tiny-cpu: 150)" in text
    )


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("birkhoff 0.")


def recorded(tmp_path: Path, preset) -> Path:
    """A stand-in checkpoint directory whose meta records `preset` (what resume_notes reads)."""
    import hashlib

    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    meta = json.dumps({"step": 3, "extra": {"config": as_settings(preset)}}).encode()
    (ckpt / "meta.json").write_bytes(meta)
    digest = {"bytes": len(meta), "sha256": hashlib.sha256(meta).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps({"files": {"meta.json": digest}}))
    return ckpt


def test_resume_refuses_another_model_with_a_short_diff(tmp_path) -> None:
    base = tiny_cpu()
    ckpt = recorded(tmp_path, base)
    other = base.replace(model=base.model.replace(dim=32, num_layers=3))
    with pytest.raises(UsageError) as exc:
        resume_notes(ckpt, other)
    lines = str(exc.value).splitlines()
    assert lines[1:3] == ["  model.dim: 64 -> 32", "  model.num_layers: 2 -> 3"]
    assert len(lines) == 4 and len(str(exc.value)) < 300


def test_resume_accepts_run_time_changes_with_a_note(tmp_path) -> None:
    base = tiny_cpu()
    ckpt = recorded(tmp_path, base)
    assert base.rl is not None
    later = base.replace(rl=base.rl.replace(num_steps=300, eval_every=5))
    notes = resume_notes(ckpt, later)
    assert notes[1:] == ["  rl.eval_every: 10 -> 5", "  rl.num_steps: 150 -> 300"]
    assert resume_notes(ckpt, base) == []


def test_a_run_checkpoint_records_its_resolved_config(tmp_path, capsys) -> None:
    args = [
        "run",
        "--out",
        str(tmp_path),
        "--warmup-steps",
        "1",
        "--steps",
        "0",
        "--set",
        "rl.num_eval_prompts=2",
        "--no-progress",
    ]
    assert main(args) == 0
    from birkhoff.runtime.dcp import checkpoint_extra

    config = checkpoint_extra(tmp_path / "checkpoint")["config"]
    assert config["rl"]["warmup_steps"] == 1 and config["rl"]["num_eval_prompts"] == 2
    capsys.readouterr()
    again = [
        "run",
        "--out",
        str(tmp_path),
        "--resume",
        "--warmup-steps",
        "1",
        "--steps",
        "0",
        "--no-progress",
        "--set",
        "model.dim=32",
    ]
    assert main(again) == 2
    assert "model.dim: 64 -> 32" in capsys.readouterr().err


def test_task_settings_are_checked_before_anything_runs(tmp_path: Path, capsys) -> None:
    out = ["--out", str(tmp_path / "r")]
    assert main(["train", *out, "--set", "task_options.num_digits=0"]) == 2
    err = capsys.readouterr().err
    assert "--set task_options.num_digits=0 is invalid: must be an int in [1, 18]" in err
    assert main(["run", *out, "--task_options.nope", "1"]) == 2
    assert "bad options" in capsys.readouterr().err
    assert main(["train", *out, "--set", "model.max_seq_len=6"]) == 2
    err = capsys.readouterr().err
    assert (
        "model.max_seq_len=6 is too short for task 'addition': prompt + answer take up to 8" in err
    )
    assert "(with --set model.max_seq_len=6)" in err
    # a rollout needs room for the prompt and rl.max_new_tokens; supervised training does not
    assert main(["run", *out, "--set", "model.max_seq_len=8"]) == 2
    assert "prompts of up to 5 tokens + 4 new tokens" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_missing_checkpoint_is_named_with_its_flag(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nope"
    assert main(["run", "--out", str(tmp_path / "r"), "--init", str(missing)]) == 2
    assert f"--init {missing}: no such checkpoint directory" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(missing)]) == 2
    assert f"--checkpoint {missing}: no such checkpoint directory" in capsys.readouterr().err


def test_checkpoint_every_is_a_flag_of_both_jobs(tmp_path: Path, capsys) -> None:
    for job, setting in (("run", "rl"), ("train", "train")):
        assert main([job, "--out", str(tmp_path / job), "--checkpoint-every", "-1"]) == 2
        assert "--checkpoint-every -1 is invalid: must be an int >= 0" in capsys.readouterr().err
        assert main(["presets", "tiny-cpu", "--set", f"{setting}.checkpoint_every=7"]) == 0
        assert "checkpoint_every = 7" in capsys.readouterr().out


def test_help_shows_a_default_of_zero(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "sampling seed (default: 0)" in " ".join(capsys.readouterr().out.split())


def test_overwrite_removes_the_old_runs_tracking_logs(tmp_path) -> None:
    from birkhoff.cli.resume import prepare_run_dir
    from birkhoff.cli.run import RUN_OUTPUTS
    from birkhoff.presets import get_preset

    for name in ("metrics.jsonl", "tensorboard/events.out", "wandb/run/x", "keep.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("old")
    prepare_run_dir(
        tmp_path, get_preset("tiny-cpu"), resume=False, overwrite=True, outputs=RUN_OUTPUTS
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
