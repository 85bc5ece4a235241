"""Module-scoped real set-ups for the conformance runs: daemons and balancers started once per test module.

The per-test `daemon`/`balancer` fixtures start processes per test; the
conformance modules run many checks against one set-up, so they start it
once, with the same launcher and the same teardown checks (`DaemonSet`:
exit 0, no shared memory and no worker left).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import orjson

from daemon_procs import START_TIMEOUT_S, DaemonProc, DaemonSet
from repo_root import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "engine", "balancer"))  # the balancer tests' process helpers
from balancer_procs import BalancerProc, start_balancer, stop_and_check, tcp_endpoint  # noqa: E402


class Procs(DaemonSet):
    """Processes of one set-up: its daemons (each on its own board id) and balancers."""

    def __init__(self) -> None:
        super().__init__(tempfile.mkdtemp(prefix="ncf-", dir="/tmp"))
        self.balancers: list[BalancerProc] = []

    def daemon(self, *, backend: str = "ref", chips: int = 1, settings: dict | None = None,
               tcp: bool = False, extra: list[str] | None = None) -> tuple[DaemonProc, str | None]:
        """A daemon on an ipc:// endpoint (admin rights) and, with `tcp`, a tcp:// one too (none)."""
        ep_tcp = tcp_endpoint() if tcp else None
        d = self.start(backend=backend, chips=chips, settings=settings,
                       extra=(["--endpoint", ep_tcp] if tcp else []) + list(extra or []),
                       board=f"t{os.getpid() % 100000}c{len(self.daemons)}")
        return d, ep_tcp

    def balancer(self, backends: list, policy: str = "round-robin") -> BalancerProc:
        b = start_balancer(self.dir, len(self.balancers), backends=backends, policy=policy)
        self.balancers.append(b)
        b.wait_backends_up(len(backends), timeout=START_TIMEOUT_S)
        return b

    def log_tails(self, n: int = 2000) -> str:
        """The end of every process's log, for a failure message."""
        return "\n".join(f"--- {p.log_path}\n{p.log()[-n:]}" for p in [*self.daemons, *self.balancers])

    def close(self) -> list[str]:
        problems = stop_and_check(self.balancers) + super().close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return problems


def run_conformance(capsys, endpoint: str, *flags: str) -> tuple[int, dict[str, dict], dict]:
    """`npuserve conformance ENDPOINT --json FLAGS`, in this process: (exit status, rows by check, summary)."""
    from tools.conformance_cmd import main

    capsys.readouterr()
    code = main([endpoint, "--json", "--timeout", "120", *flags])
    lines = [orjson.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    rows = {r["check"]: r for r in lines if r["kind"] == "row"}
    (summary,) = [r for r in lines if r["kind"] == "summary"]
    return code, rows, summary


def assert_conforms(code: int, rows: dict[str, dict], skipped: set[str], procs: Procs | None = None) -> None:
    """Every check ran and passed, except exactly the `skipped` ones (their set-up is not offered)."""
    failed = {n: r["detail"] for n, r in rows.items() if r["status"] == "fail"}
    assert not failed, f"{failed}\n{procs.log_tails() if procs else ''}"
    assert {n for n, r in rows.items() if r["status"] == "skip"} == skipped, \
        {n: r["detail"] for n, r in rows.items() if r["status"] == "skip"}
    assert code == 0
