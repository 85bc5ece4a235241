"""The HTTP front tests' own fixture: `npuserve http` processes stopped and checked per test."""

from __future__ import annotations

import os

import pytest

from http_front_procs import HttpFrontProc, start_http_front


@pytest.fixture
def http_front(short_dir):
    """Factory: `http_front(upstream_endpoint, args=[...], wait_up=True)` -> HttpFrontProc; stopped (exit 0
    asserted) on teardown."""
    started: list[HttpFrontProc] = []

    def start(upstream: str, args: list[str] | None = None, wait_up: bool = True) -> HttpFrontProc:
        f = start_http_front(upstream, os.path.join(short_dir, f"http{len(started)}.log"), args, wait_up=wait_up)
        started.append(f)
        return f

    yield start
    problems = [f"http front exited {rc}:\n{f.log()[-3000:]}" for f in started if (rc := f.stop()) != 0]
    assert not problems, "\n".join(problems)
