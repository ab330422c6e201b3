"""runtime.stop: the flag, the exit code, the command that resumes a run."""

import signal

from birkhoff.runtime.stop import StopFlag, exit_code, resume_command, stop_on_signals


def test_the_first_reason_stays() -> None:
    flag = StopFlag()
    assert not flag.requested
    flag.request("SIGTERM")
    flag.request("SIGINT")
    assert flag.requested and flag.reason == "SIGTERM"


def test_exit_codes_follow_the_shell() -> None:
    assert (exit_code("SIGINT"), exit_code("SIGTERM")) == (130, 143)
    assert exit_code("--stop-after") == exit_code(None) == 0


def test_handlers_raise_the_flag_and_are_restored() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals(StopFlag()) as flag:
        signal.raise_signal(signal.SIGTERM)
        assert flag.reason == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_resume_command() -> None:
    argv = ["run", "--preset", "tiny-cpu", "--out", "runs/a b", "--overwrite", "--stop-after", "9"]
    assert resume_command(argv, reason="SIGINT") == (
        "birkhoff run --preset tiny-cpu --out 'runs/a b' --stop-after 9 --resume"
    )
    assert resume_command(argv, reason="--stop-after") == (
        "birkhoff run --preset tiny-cpu --out 'runs/a b' --resume"
    )
    assert resume_command(["run", "--stop-after=3", "--resume"], reason="--stop-after") == (
        "birkhoff run --resume"
    )
    assert resume_command(["run"], reason="SIGTERM", world_size=4) == (
        "torchrun --nproc-per-node=4 -m birkhoff run --resume"
    )
