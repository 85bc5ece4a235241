"""Fixtures the worker tests share."""

from __future__ import annotations

import pytest

from workers.backends.ref import RefBackend


@pytest.fixture
def backend(package):
    """A ref backend loaded with the test module's `package`, fresh per test (no KV left by another)."""
    b = RefBackend()
    b.load(package)
    yield b
    b.unload()
