"""Progress of a job: a tqdm bar on a terminal, plain lines in a log.

Off a terminal (the stream is not a TTY: a file, a pipe, a job scheduler's log) a carriage-return
bar writes one update per step, each with the whole postfix, into the log. `Progress` then prints
one plain line instead, when `every_steps` steps or `every_s` seconds have passed since the last
line, whichever comes first, and always for the last step:
    tiny-cpu step 120/250 (4.1 step/s) main_loss=0.021 reward=0.562
On a terminal it is a tqdm bar with the same figures as its postfix.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from tqdm import tqdm


class Progress:
    """`update(postfix)` after each step; a context manager that closes the bar on exit."""

    def __init__(
        self,
        *,
        total: int,
        initial: int = 0,
        desc: str,
        enabled: bool = True,
        file: TextIO | None = None,
        every_steps: int | None = None,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.step, self.desc, self.enabled = total, initial, desc, enabled
        self.file = sys.stdout if file is None else file
        self.every_steps = every_steps or max(1, total // 20)
        self.every_s, self.clock = every_s, clock
        self.bar: tqdm | None = None
        if enabled and self.file.isatty():
            self.bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                file=self.file,
                unit="step",
                dynamic_ncols=True,
            )
        self.start_step, self.start_s = initial, clock()
        self.line_step, self.line_s = initial, self.start_s

    def update(self, postfix: dict[str, str]) -> None:
        """One step is done; `postfix` holds the figures to show (already formatted)."""
        self.step += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(postfix, refresh=False)
            return
        now = self.clock()
        due = (
            self.step - self.line_step >= self.every_steps
            or now - self.line_s >= self.every_s
            or self.step == self.total
        )
        if self.enabled and due:
            self.print_line(postfix, now)

    def print_line(self, postfix: dict[str, str], now: float) -> None:
        rate = (self.step - self.start_step) / max(now - self.start_s, 1e-9)
        figures = " ".join(f"{k}={v}" for k, v in postfix.items())
        print(
            f"{self.desc} step {self.step}/{self.total} ({rate:.1f} step/s) {figures}".rstrip(),
            file=self.file,
            flush=True,
        )
        self.line_step, self.line_s = self.step, now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
