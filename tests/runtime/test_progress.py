"""Progress: plain lines off a terminal (every N steps or T seconds, and the last), tqdm on one."""

import io

from birkhoff.runtime.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_plain_line_every_n_steps_and_the_last():
    out, clock = io.StringIO(), Clock()
    with Progress(total=25, desc="job", file=out, every_steps=10, clock=clock) as bar:
        for step in range(25):
            clock.now += 0.5
            bar.update({"loss": f"{1 / (step + 1):.3f}"})
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == [
        "job step 10/25 (2.0 step/s) loss=0.100",
        "job step 20/25 (2.0 step/s) loss=0.050",
        "job step 25/25 (2.0 step/s) loss=0.040",
    ]


def test_off_a_terminal_slow_steps_print_every_few_seconds():
    out, clock = io.StringIO(), Clock()
    bar = Progress(total=100, initial=40, desc="run", file=out, every_steps=50, every_s=30.0,
                   clock=clock)  # fmt: skip
    for _ in range(6):
        clock.now += 12.0
        bar.update({})
    assert [line.split(" (")[0] for line in out.getvalue().splitlines()] == [
        "run step 43/100",  # 36 s after the start
        "run step 46/100",  # 36 s after that line
    ]


def test_disabled_prints_nothing():
    out = io.StringIO()
    with Progress(total=3, desc="job", file=out, enabled=False) as bar:
        for _ in range(3):
            bar.update({"loss": "1.000"})
    assert out.getvalue() == ""


def test_on_a_terminal_it_is_a_bar():
    out = Terminal()
    with Progress(total=3, desc="job", file=out) as bar:
        for _ in range(3):
            bar.update({"loss": "1.000"})
    assert bar.bar is not None and "\r" in out.getvalue() and "3/3" in out.getvalue()
