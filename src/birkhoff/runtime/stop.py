"""Graceful stop: SIGINT and SIGTERM end a run at a step boundary, with a checkpoint.

The first signal only raises a flag (`StopFlag`); the loop reads it between steps, so the step in
progress finishes, a checkpoint of the steps done is written and the loop returns; the command
line then prints one line: the step the checkpoint holds and the command that resumes it
(`resume_command`). A second signal exits at once with code 128 + its number, writing nothing
more: checkpoints are atomic, so the previous one stays whole. Schedulers send SIGTERM some time
before they kill a job (preemption); a step longer than that grace period is lost, the
checkpoint before it is not.
Under torchrun every rank gets the signal, not necessarily before the same step, so the loop
takes the max of the flag over ranks before acting on it.
Left out: abandoning a step half-way (its rollouts are cheap to redo, its update is not undone).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_AFTER = "--stop-after"  # the reason of a stop the command line asked for


class StopFlag:
    """Set once, by a signal handler or a caller; read by the loop between steps."""

    def __init__(self) -> None:
        self.reason: str | None = None  # "SIGINT", "SIGTERM", or a caller's word

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason


def exit_code(reason: str | None) -> int:
    """128 + the signal's number for a signal (the shell's convention), else 0."""
    names = {s.name: int(s) for s in STOP_SIGNALS}
    return 128 + names[reason] if reason in names else 0


@contextmanager
def stop_on_signals(flag: StopFlag) -> Iterator[StopFlag]:
    """While inside: SIGINT / SIGTERM raise `flag`; a second one exits the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield flag  # only the main thread may install handlers
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if flag.requested:
            print(
                f"\n{name} again: exiting now; the last checkpoint written stays whole",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            os._exit(128 + signum)
        flag.request(name)
        print(
            f"\n{name}: stopping after the current step with a checkpoint "
            "(send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def resume_command(argv: Sequence[str], *, reason: str | None, world_size: int = 1) -> str:
    """The command line that continues a stopped run: the same arguments, `--resume` added,
    `--overwrite` dropped, and `--stop-after` dropped when that is what stopped it."""
    args: list[str] = []
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg == "--overwrite" or (arg.startswith(STOP_AFTER + "=") and reason == STOP_AFTER):
            pass
        elif arg == STOP_AFTER and reason == STOP_AFTER:
            skip_value = True
        else:
            args.append(arg)
    if "--resume" not in args:
        args.append("--resume")
    launcher = ["birkhoff"]
    if world_size > 1:
        launcher = ["torchrun", f"--nproc-per-node={world_size}", "-m", "birkhoff"]
    return shlex.join([*launcher, *args])
