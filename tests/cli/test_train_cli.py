import json
import subprocess
import sys

import pytest
import torch

from birkhoff.cli import main
from birkhoff.runtime.checkpoint import load_checkpoint


def test_train_writes_metrics_and_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny-cpu", "--out", str(out), "--steps", "12",
                 "--seed", "3", "--no-progress"]) == 0  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 10, 11]  # every log_every=10 steps, and the last
    assert {"main_loss", "mtp_loss_1", "grad_norm", "lr"} <= records[0].keys()
    assert records[-1]["main_loss"] < records[0]["main_loss"]
    loaded = load_checkpoint(out / "checkpoint")
    assert loaded.step == 12 and loaded.extra["preset"] == "tiny-cpu" and loaded.extra["seed"] == 3
    printed = capsys.readouterr().out
    assert "main loss" in printed and "mtp loss" in printed and "->" in printed


def test_unknown_preset_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--preset", "huge", "--out", str(out)]) == 2
    assert "preset='huge' is unknown" in capsys.readouterr().err
    assert not out.exists()


def test_unwritable_out_dir_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["train", "--out", str(blocker / "run"), "--steps", "1"]) == 2
    assert "not writable" in capsys.readouterr().err
    assert main(["train", "--out", str(blocker), "--steps", "1"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_previous_run_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("keep\n")
    assert main(["train", "--out", str(tmp_path), "--steps", "1"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == "keep\n"


def test_bad_override_exits_2(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "0"]) == 2
    assert "--steps 0 is invalid: must be an int >= 1" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_bf16_preset_on_cpu_exits_2(tmp_path, capsys):
    assert main(["train", "--preset", "h200-small", "--out", str(tmp_path / "r")]) == 2
    assert "needs CUDA" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_console_entry_point_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "birkhoff.cli", "train", "--preset", "nope", "--out",
         str(tmp_path / "x")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "valid presets" in proc.stderr


def test_missing_subcommand_is_a_usage_error():
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_docstring_names_exactly_the_subcommands():
    import re

    import birkhoff.cli as cli

    line = next(ln for ln in cli.__doc__.splitlines() if ln.startswith("Subcommands:"))
    assert set(re.findall(r"`([a-z-]+)`", line)) == set(cli.SUBCOMMANDS)
    assert set(cli.build_parser()._subparsers._group_actions[0].choices) == set(cli.SUBCOMMANDS)


def test_progress_off_a_terminal_is_plain_lines(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--steps", "40"]) == 0
    printed = capsys.readouterr().out
    assert "\r" not in printed
    steps = [ln.split(" (")[0] for ln in printed.splitlines() if ln.startswith("train tiny-cpu")]
    assert steps == [f"train tiny-cpu step {n}/40" for n in range(2, 41, 2)]  # every 40 // 20
