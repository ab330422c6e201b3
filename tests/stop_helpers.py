"""Stopping a real `birkhoff` process as a user does: shared by the `run` and `train` CLI tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def rows(out: Path) -> list[dict]:
    """The metrics rows a run wrote under `out` (none before its first row)."""
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def signal_after_rows(
    argv: list[str], out: Path, sig: signal.Signals, *, num_rows: int = 2
) -> tuple[int, str, str]:
    """Run `python -m birkhoff ARGV`, send `sig` once it has written `num_rows` metrics rows
    under `out`, and return (exit code, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    cmd = [sys.executable, "-m", "birkhoff", *argv]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(rows(out)) < num_rows and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout, stderr
