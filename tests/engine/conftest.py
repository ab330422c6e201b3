"""Fixtures of the engine tests (helpers live in engine_helpers.py)."""

from __future__ import annotations

import pytest
from engine_helpers import trained_tiny_model

from birkhoff.model import Transformer


@pytest.fixture(scope="session")
def trained_model() -> Transformer:
    return trained_tiny_model()
