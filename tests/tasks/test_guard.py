"""Guarded user verifiers: raising, sleeping and flaky functions score 0, are counted, and a
failure rate over the limit stops the run with a clear message."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from birkhoff.tasks.guard import GuardedVerifier, VerifierFailureError, call_with_timeout
from birkhoff.tasks.problems import Problem
from birkhoff.tasks.verifiers import get_verifier

CHECKS = """
import time
calls = 0

def raising(problem, completion):
    return {}["missing"]

def sleeping(problem, completion):
    try:
        time.sleep(30)
    except Exception:  # a broad except must not swallow the timeout
        return 1.0
    return 1.0

def flaky(problem, completion):
    global calls
    calls += 1
    if calls % 4 == 0:
        raise RuntimeError("every fourth call fails")
    return completion == problem.answer

def bad_value(problem, completion):
    return "yes"
"""
PROBLEM = Problem("q", "a")


@pytest.fixture
def checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "guard_checks.py").write_text(CHECKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("guard_checks", None)
    yield
    sys.modules.pop("guard_checks", None)


def test_raising_verifier_scores_zero_logs_once_then_stops(
    checks: None, caplog: pytest.LogCaptureFixture
) -> None:
    check = get_verifier("guard_checks:raising", min_calls=10, max_failure_rate=0.5)
    assert isinstance(check, GuardedVerifier)
    with caplog.at_level(logging.WARNING, logger="birkhoff.tasks.guard"):
        assert [check(PROBLEM, "a") for _ in range(9)] == [0.0] * 9
    assert check.counts() == {"verifier_calls": 9, "verifier_errors": 9, "verifier_timeouts": 0}
    assert len(caplog.records) == 1  # the first traceback of the kind, once
    assert "KeyError" in caplog.text and "Traceback" in caplog.text
    with pytest.raises(VerifierFailureError, match=r"failed on 10 of 10 completions.*KeyError"):
        check(PROBLEM, "a")


def test_sleeping_verifier_times_out(checks: None) -> None:
    check = get_verifier("guard_checks:sleeping", timeout_s=0.05)
    start = time.monotonic()
    assert check(PROBLEM, "a") == 0.0 and check(PROBLEM, "a") == 0.0
    assert time.monotonic() - start < 5
    assert check.counts()["verifier_timeouts"] == 2
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL  # the handler is restored


def test_timeout_off_the_main_thread(checks: None) -> None:
    check = get_verifier("guard_checks:sleeping", timeout_s=0.05)
    scores: list[float] = []
    thread = threading.Thread(target=lambda: scores.append(check(PROBLEM, "a")))
    thread.start()
    thread.join(5)
    assert scores == [0.0] and check.counts()["verifier_timeouts"] == 1


def test_flaky_verifier_counts_failures_under_the_limit(checks: None) -> None:
    lenient = get_verifier("guard_checks:flaky", min_calls=8, max_failure_rate=0.3)
    scores = [lenient(PROBLEM, "a") for _ in range(40)]
    assert scores.count(0.0) == 10 and lenient.counts()["verifier_errors"] == 10
    strict = get_verifier("guard_checks:flaky", min_calls=8, max_failure_rate=0.2)
    with pytest.raises(VerifierFailureError, match="RuntimeError: every fourth call fails"):
        for _ in range(40):
            strict(PROBLEM, "a")


def test_bad_return_value_is_a_counted_error(checks: None) -> None:
    check = get_verifier("guard_checks:bad_value", min_calls=1, max_failure_rate=0.0)
    with pytest.raises(VerifierFailureError, match="returned 'yes'"):
        check(PROBLEM, "a")


def test_an_earlier_timer_is_restored() -> None:
    fired: list[int] = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        assert call_with_timeout(lambda: 7, 5.0) == 7
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 0.3
        time.sleep(0.5)
        assert fired == [1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_guard_options_are_checked() -> None:
    inner = get_verifier("exact")
    with pytest.raises(ValueError, match="timeout_s"):
        GuardedVerifier(inner, timeout_s=0)
    with pytest.raises(ValueError, match="max_failure_rate"):
        GuardedVerifier(inner, max_failure_rate=2)
