"""User verifiers that misbehave score 0 instead of ending the run; too many failures stop it.

`GuardedVerifier` wraps a "module:function" verifier (verifiers.py). Each call runs with a
per-call timeout; an exception or a timeout scores 0.0 and is counted (`counts()`), the first
failure of each kind logged with its traceback. Once `min_calls` calls were made and more than
`max_failure_rate` of them failed, the next failure raises `VerifierFailureError`. In the main
thread SIGALRM interrupts the call (a BaseException a verifier cannot swallow); elsewhere the
call runs in a daemon thread abandoned at the timeout. Details: docs/tasks.md.
Left out: process isolation (a verifier shares the run's process and memory).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

TIMEOUT_S = 10.0
MAX_FAILURE_RATE = 0.1
MIN_CALLS = 50


class VerifierTimeout(BaseException):  # noqa: N818 (an interrupt, like KeyboardInterrupt)
    """A verifier call ran past its timeout (BaseException: `except Exception` lets it pass)."""


class VerifierFailureError(RuntimeError):
    """A user verifier failed on more completions than the run allows."""


class Scorer(Protocol):
    name: str

    def check_answer(self, answer: str) -> None: ...

    def __call__(self, problem: Any, completion: str) -> float: ...


def call_with_timeout(fn: Callable[[], T], timeout_s: float) -> T:
    """fn() or VerifierTimeout after `timeout_s` seconds (see the module docstring)."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return call_with_alarm(fn, timeout_s)
    return call_in_thread(fn, timeout_s)


def call_with_alarm(fn: Callable[[], T], timeout_s: float) -> T:
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise VerifierTimeout

    old_handler = signal.signal(signal.SIGALRM, interrupt)
    old_delay, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.monotonic()
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:  # someone else's timer: re-arm what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - start), 1e-3))


def call_in_thread(fn: Callable[[], T], timeout_s: float) -> T:
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as err:  # noqa: BLE001 (re-raised in the caller's thread)
            error.append(err)

    thread = threading.Thread(target=target, daemon=True, name="verifier")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise VerifierTimeout
    if error:
        raise error[0]
    return result[0]


class GuardedVerifier:
    """A verifier whose failures (exceptions, timeouts) score 0 and are counted."""

    def __init__(
        self,
        inner: Scorer,
        *,
        timeout_s: float = TIMEOUT_S,
        max_failure_rate: float = MAX_FAILURE_RATE,
        min_calls: int = MIN_CALLS,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid: must be > 0")
        if not 0 <= max_failure_rate <= 1:
            raise ValueError(f"max_failure_rate={max_failure_rate!r} is invalid: in [0, 1]")
        self.inner, self.name = inner, inner.name
        self.timeout_s, self.max_failure_rate, self.min_calls = (
            timeout_s,
            max_failure_rate,
            min_calls,
        )
        self.num_calls = self.num_errors = self.num_timeouts = 0
        self.first: dict[str, str] = {}  # kind -> first message

    def check_answer(self, answer: str) -> None:
        self.inner.check_answer(answer)

    def __call__(self, problem: Any, completion: str) -> float:
        self.num_calls += 1
        try:
            return call_with_timeout(lambda: self.inner(problem, completion), self.timeout_s)
        except VerifierTimeout:
            self.num_timeouts += 1
            self.failed("timeout", f"took longer than {self.timeout_s:g} s")
        except Exception as err:  # noqa: BLE001 (user code: any exception scores 0)
            self.num_errors += 1
            self.failed(type(err).__name__, "".join(traceback.format_exception(err)).rstrip())
        return 0.0

    def failed(self, kind: str, detail: str) -> None:
        """Log the first failure of each kind; stop once failures exceed the allowed rate."""
        if kind not in self.first:
            self.first[kind] = detail.splitlines()[-1]
            log.warning(
                "verifier %s failed (%s; scored 0, logged once per kind):\n%s",
                self.name,
                kind,
                detail,
            )
        failures = self.num_errors + self.num_timeouts
        if self.num_calls >= self.min_calls and failures > self.max_failure_rate * self.num_calls:
            kinds = "; ".join(f"{k}: {v}" for k, v in self.first.items())
            raise VerifierFailureError(
                f"verifier {self.name} failed on {failures} of {self.num_calls} completions "
                f"({self.num_errors} errors, {self.num_timeouts} timeouts over "
                f"{self.timeout_s:g} s), more than max_failure_rate={self.max_failure_rate:g}; "
                f"first of each kind: {kinds}"
            )

    def counts(self) -> dict[str, int]:
        """Calls, errors and timeouts so far."""
        return {
            "verifier_calls": self.num_calls,
            "verifier_errors": self.num_errors,
            "verifier_timeouts": self.num_timeouts,
        }
