"""`birkhoff run` stopped and resumed as a user does it: a real SIGINT, the one line it prints,
the command it names, `--resume` on a finished run, contradictory flags."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from stop_helpers import SRC, rows, signal_after_rows

from birkhoff.cli import main

SMALL = ["--warmup-steps", "3", "--steps", "1", "--no-progress"]


def test_sigint_checkpoints_and_prints_the_resume_command(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["run", "--out", str(out), "--warmup-steps", "400",
           "--steps", "2", "--no-progress"]  # fmt: skip
    code, stdout, stderr = signal_after_rows(argv, out, signal.SIGINT)
    assert code == 130, stderr
    assert "Traceback" not in stdout + stderr
    lines = stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stopped (SIGINT): "), stdout
    steps = len(rows(out))
    assert f"{out / 'checkpoint'} holds step {steps} of 402; resume with: " in lines[0]
    command = shlex.split(lines[0].split("resume with: ")[1])
    assert command[:2] == ["birkhoff", "run"] and command[-1] == "--resume"
    # the printed command continues the run (here: shortened to stop 2 steps later)
    assert main([*command[1:], "--stop-after", str(steps + 2)]) == 0
    assert [r["step"] for r in rows(out)] == list(range(steps + 2))


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    code = (
        "import time\n"
        "from birkhoff.runtime.stop import StopFlag, stop_on_signals\n"
        "with stop_on_signals(StopFlag()):\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert proc.poll() is None  # the first one only asks for a stop
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "SIGTERM: stopping after the current step" in stderr
    assert "SIGINT again: exiting now" in stderr and "Traceback" not in stderr


def test_resume_says_where_it_continues_and_that_a_finished_run_is_done(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--out", str(tmp_path)]
    assert main(["run", *out, *SMALL, "--stop-after", "2"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("stopped (--stop-after): ")
    assert printed[-1].endswith(f"resume with: birkhoff run --out {tmp_path} " + " ".join(SMALL)
                                + " --resume")  # fmt: skip
    assert main(["run", *out, *SMALL, "--resume"]) == 0
    printed = capsys.readouterr().out
    assert f"resuming {tmp_path} at step 3 of 4 (warm-up step 3 of 3)" in printed
    assert "eval_reward" in printed  # the finished run's summary
    finished = rows(tmp_path)
    assert main(["run", *out, *SMALL, "--resume"]) == 0
    assert "is finished (4 of 4 steps); nothing to run" in capsys.readouterr().out
    assert rows(tmp_path) == finished


def test_contradictory_flags_are_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path)]
    assert main(["run", *out, *SMALL, "--resume", "--overwrite"]) == 2
    assert "--resume continues the run in --out, --overwrite replaces it" in capsys.readouterr().err
    assert main(["run", *out, *SMALL, "--stop-after", "2"]) == 0
    assert main(["run", *out, *SMALL, "--resume", "--stop-after", "1"]) == 2
    assert "--stop-after 1: the checkpoint already holds step 2" in capsys.readouterr().err
    assert main(["run", *out, *SMALL]) == 2  # a plain rerun names both ways on
    assert "pass --resume to continue it or --overwrite to replace it" in capsys.readouterr().err
