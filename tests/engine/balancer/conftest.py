"""The balancer tests' own fixture: balancer processes stopped and checked per test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from balancer_procs import BalancerProc, tcp_endpoint, write_config
from repo_root import ROOT


@pytest.fixture
def balancer(short_dir):
    """Factory: `balancer(backends=[...], policy=..., extra_toml=...)` -> BalancerProc (a tcp:// endpoint)."""
    started: list[BalancerProc] = []

    def start(*, backends: list, policy: str = "round-robin", extra_toml: str = "", endpoint: str | None = None,
              wait_up: int | None = None, health_kw: dict | None = None) -> BalancerProc:
        n = len(started)
        endpoint = endpoint or tcp_endpoint()
        cfg = write_config(os.path.join(short_dir, f"bal{n}.toml"), endpoint=endpoint, backends=backends,
                           policy=policy, extra=extra_toml)
        log_path = os.path.join(short_dir, f"bal{n}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "engine.balancer.main", "--config", cfg], cwd=ROOT,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        b = BalancerProc(proc, endpoint, short_dir, log_path, config_path=cfg)
        started.append(b)
        b.wait_backends_up(len(backends) if wait_up is None else wait_up, **(health_kw or {}))
        return b

    yield start
    problems = []
    for b in started:
        rc = b.stop() if b.proc.poll() is None else b.proc.returncode
        if b.expect_exit is not None and rc != b.expect_exit:
            problems.append(f"balancer {b.pid} exited {rc}:\n{b.log()[-3000:]}")
    assert not problems, "\n".join(problems)
