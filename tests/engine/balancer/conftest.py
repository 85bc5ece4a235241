"""The balancer tests' own fixture: balancer processes stopped and checked per test."""

from __future__ import annotations

import pytest

from balancer_procs import BalancerProc, start_balancer, stop_and_check


@pytest.fixture
def balancer(short_dir):
    """Factory: `balancer(backends=[...], policy=..., extra_toml=...)` -> BalancerProc (a tcp:// endpoint)."""
    started: list[BalancerProc] = []

    def start(*, backends: list, policy: str = "round-robin", extra_toml: str = "", endpoint: str | None = None,
              wait_up: int | None = None, health_kw: dict | None = None) -> BalancerProc:
        b = start_balancer(short_dir, len(started), backends=backends, policy=policy, extra_toml=extra_toml,
                           endpoint=endpoint)
        started.append(b)
        b.wait_backends_up(len(backends) if wait_up is None else wait_up, **(health_kw or {}))
        return b

    yield start
    problems = stop_and_check(started)
    assert not problems, "\n".join(problems)
