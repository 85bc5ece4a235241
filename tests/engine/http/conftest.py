"""The HTTP front tests' own fixtures: `npuserve http` processes stopped and checked per test, and one Gemma
board with its front shared by the files that need `make run`'s setup."""

from __future__ import annotations

import os

import pytest

from daemon_procs import daemon_process
from http_front_procs import HttpFrontProc, http_front_process, start_http_front


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


@pytest.fixture(scope="session")
def gemma_front(gemma_package):
    """`make run`'s setup: a Gemma 3 270M daemon on llama.cpp (alias gemma3-270m) and an HTTP front without
    --chat-template (chat uses llama.cpp's built-in `gemma` format). Yields (DaemonProc, HttpFrontProc)."""
    with daemon_process("llamacpp", extra=["--package", gemma_package],
                        # the worker's first constrained lane builds llguidance's view of Gemma's 262k-token
                        # vocabulary (1.5 s quiet, 10 s and more on a loaded machine) inside that job and sends no
                        # heartbeat meanwhile: a worker or job timeout is not these tests' subject
                        settings={"board.threads_per_chip": 1, "model.alias": "gemma3-270m",
                                  "recovery.heartbeat_timeout_ms": 300000, "executor.job_timeout_ms": 300000}) as d, \
            http_front_process(d.endpoint) as front:
        yield d, front
