"""`birkhoff train` stopped and resumed as a user does it: a real SIGTERM, the one line it
prints, the command it names, `--resume` on a finished run, contradictory flags."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path

import pytest
from stop_helpers import rows, signal_after_rows

from birkhoff.cli import main

SMALL = ["--steps", "6", "--set", "train.batch_size=8", "--set", "train.log_every=1",
         "--no-progress"]  # fmt: skip


def test_sigterm_checkpoints_and_prints_the_resume_command(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--steps", "4000",
           "--set", "train.batch_size=8", "--train.log_every", "1", "--no-progress"]  # fmt: skip
    code, stdout, stderr = signal_after_rows(argv, out, signal.SIGTERM)
    assert code == 143, stderr
    assert "Traceback" not in stdout + stderr
    assert "SIGTERM: stopping after the current step" in stderr
    lines = stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stopped (SIGTERM): "), stdout
    steps = len(rows(out))  # one row per step (log_every 1), each step's row before the stop
    assert f"{out / 'checkpoint'} holds step {steps} of 4000; resume with: " in lines[0]
    command = shlex.split(lines[0].split("resume with: ")[1])
    assert command[:2] == ["birkhoff", "train"] and command[-1] == "--resume"
    # the printed command continues the run (here: shortened to stop 2 steps later)
    assert main([*command[1:], "--stop-after", str(steps + 2)]) == 0
    assert [r["step"] for r in rows(out)] == list(range(steps + 2))


def test_resume_says_where_it_continues_and_that_a_finished_run_is_done(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--out", str(tmp_path)]
    assert main(["train", *out, *SMALL, "--stop-after", "2"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == [
        f"stopped (--stop-after): {tmp_path / 'checkpoint'} holds step 2 of 6; resume with: "
        f"birkhoff train --out {tmp_path} {shlex.join(SMALL)} --resume"
    ]
    assert main(["train", *out, *SMALL, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert f"resuming {tmp_path} at step 3 of 6" in printed
    assert "held-out greedy exact match" in printed  # the finished run's summary
    finished = rows(tmp_path)
    assert [r["step"] for r in finished] == list(range(6))
    assert main(["train", *out, *SMALL, "--resume"]) == 0
    assert "is finished (6 of 6 steps); nothing to run" in capsys.readouterr().out
    assert rows(tmp_path) == finished
    # more steps continue it
    assert main(["train", *out, *SMALL, "--steps", "7", "--resume"]) == 0
    assert "--resume: settings changed since the checkpoint" in capsys.readouterr().out
    assert [r["step"] for r in rows(tmp_path)] == list(range(7))


def test_contradictory_flags_are_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path)]
    assert main(["train", *out, *SMALL, "--resume"]) == 2
    assert f"--resume: {tmp_path / 'checkpoint'} does not exist" in capsys.readouterr().err
    assert main(["train", *out, *SMALL, "--resume", "--overwrite"]) == 2
    assert "--resume continues the run in --out, --overwrite replaces it" in capsys.readouterr().err
    assert main(["train", *out, *SMALL, "--stop-after", "0"]) == 2
    assert "--stop-after=0 is invalid: must be >= 1" in capsys.readouterr().err
    assert main(["train", *out, *SMALL, "--checkpoint-every", "-1"]) == 2
    assert "--checkpoint-every -1 is invalid: must be an int >= 0" in capsys.readouterr().err
    assert main(["train", *out, *SMALL, "--stop-after", "2"]) == 0
    assert main(["train", *out, *SMALL, "--resume", "--stop-after", "1"]) == 2
    assert "--stop-after 1: the checkpoint already holds step 2" in capsys.readouterr().err
    assert main(["train", *out, *SMALL]) == 2  # a plain rerun names both ways on
    assert "pass --resume to continue it or --overwrite to replace it" in capsys.readouterr().err
    assert main(["train", *out, *SMALL, "--resume", "--set", "model.dim=32"]) == 2
    assert "model.dim: 64 -> 32" in capsys.readouterr().err


def test_overwrite_leaves_nothing_of_the_old_run_to_resume(tmp_path: Path) -> None:
    # a stop (or a crash) before the new run's first checkpoint must not leave the old one
    # beside the new metrics, where --resume would pick it up
    from birkhoff.cli.resume import prepare_run_dir
    from birkhoff.cli.train import TRAIN_OUTPUTS
    from birkhoff.presets import tiny_cpu

    assert main(["train", "--out", str(tmp_path), *SMALL, "--stop-after", "3"]) == 0
    prepare_run_dir(tmp_path, tiny_cpu(), resume=False, overwrite=True, outputs=TRAIN_OUTPUTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_checkpoint_of_the_other_job_is_refused(tmp_path: Path, capsys) -> None:
    out = ["--out", str(tmp_path)]
    assert main(["train", *out, *SMALL, "--stop-after", "1"]) == 0
    assert main(["run", *out, "--resume", "--no-progress"]) == 2
    assert "holds a `birkhoff train` run; `birkhoff run` resumes only its own" in (
        capsys.readouterr().err
    )


def test_non_finite_steps_stop_train_pointing_at_its_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import birkhoff.train.loop
    from birkhoff.train.step import supervised_loss, train_step

    def nan_from_step_3(*args, **kwargs):
        if kwargs["step"] >= 3:
            kwargs["loss_fn"] = lambda m, b: (lambda lm: (lm[0] * float("nan"), lm[1]))(
                supervised_loss(m, b)
            )
        return train_step(*args, **kwargs)

    monkeypatch.setattr(birkhoff.train.loop, "train_step", nan_from_step_3)
    args = ["train", "--out", str(tmp_path), *SMALL, "--checkpoint-every", "2",
            "--set", "train.max_skipped_in_row=2"]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("birkhoff train: training stopped: steps 3-4: 2")
    assert (
        f"last good checkpoint: {tmp_path / 'checkpoint'} (step 4; --resume" in err[0]
    )  # a skipped update leaves it whole
