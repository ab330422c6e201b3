"""Fixtures of the engine tests (helpers live in engine_helpers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from engine_helpers import trained_tiny_model

from birkhoff.model import Transformer


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Engine tests use tiny tensors: one CPU thread is fastest, and several threads on a busy
    machine are many times slower. Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def trained_model() -> Transformer:
    return trained_tiny_model()
