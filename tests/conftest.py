"""Suite-wide fixtures: every test runs its tiny tensors on one intra-op thread.

Tiny models gain nothing from intra-op threads, and on shared cores extra threads spin against
each other (steps measured 10-25x slower); the previous count is restored after each test.
"""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
