"""Suite-wide settings: one intra-op thread per test; derandomized property tests under CI.

Tiny models gain nothing from intra-op threads, and on shared cores extra threads spin against
each other (steps measured 10-25x slower); the previous count is restored after each test.
Under CI (CI=true) hypothesis draws a fixed sequence of examples, so a red run is reproducible
and never depends on the day's random seed; locally it keeps exploring.
Tests marked slow run first: on a few cores the long ones start at once and the short ones fill
the other workers, instead of one long test starting last and running alone.
"""

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: else as found


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
