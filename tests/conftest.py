"""Suite-wide settings: one intra-op thread per test; derandomized property tests under CI.

Tiny models gain nothing from intra-op threads, and on shared cores extra threads spin against
each other (steps measured 10-25x slower); the previous count is restored after each test.
Under CI (CI=true) hypothesis draws a fixed sequence of examples, so a red run is reproducible
and never depends on the day's random seed; locally it keeps exploring.
Tests marked slow run first, spread over the xdist workers: on a few cores the long ones start
at once and the short ones fill in, instead of one worker running every long test in a row.
"""

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    items[:] = slow_first(items, workers)


def slow_first(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """The items as `workers` consecutive runs of the sizes pytest-xdist's worksteal deals out
    (it hands each worker one run and steals from a run's end), each run opening with its
    round-robin share of the slow tests; the others keep their order."""
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = iter([item for item in items if not item.get_closest_marker("slow")])
    out: list[pytest.Item] = []
    left = len(items)
    for w in range(workers):
        size = left // (workers - w)
        left -= size
        share = slow[w::workers]
        out += share + [item for _, item in zip(range(size - len(share)), fast, strict=False)]
    return out + list(fast)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
