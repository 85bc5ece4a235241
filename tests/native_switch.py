"""Running a test with the C library (`ipc.native_lib`) and with its NumPy fallback: both paths must agree."""

from __future__ import annotations

import pytest

from ipc import native_lib


def use_native(monkeypatch, on: bool) -> None:
    """The C library on (skips the test when it cannot be built here) or off, for the rest of the test."""
    monkeypatch.setenv("NPUSERVE_NATIVE", "1" if on else "0")
    native_lib.reset()
    if on and native_lib.library() is None:
        pytest.skip(f"no C library: {native_lib.why_not}")


@pytest.fixture(params=["native", "fallback"])
def path(request, monkeypatch):
    """The test once with the C library and once with the fallback (the param names which)."""
    use_native(monkeypatch, request.param == "native")
    yield request.param
    native_lib.reset()
