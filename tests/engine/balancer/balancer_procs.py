"""Real balancer processes for the balancer tests: start, wait until it routes, stop and check the exit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from daemon_procs import DaemonProc
from repo_root import ROOT
from tools.load.ports import free_port

START_TIMEOUT_S = 60.0


def tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@dataclass
class BalancerProc(DaemonProc):
    """A balancer process: the daemon's process helpers (client, log, stop) plus its config file."""

    config_path: str | None = None

    def wait_backends_up(self, n: int, timeout: float = 30.0, **kw) -> dict:
        deadline = time.monotonic() + timeout
        h: dict = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"balancer exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with self.client(timeout=1.0, **kw) as c:
                    h = c.health()
                if h.get("backends_up", 0) >= n:
                    return h
            except Exception:
                pass
            time.sleep(0.1)
        raise AssertionError(f"balancer has not {n} backends up within {timeout} s: {h}\n{self.log()[-3000:]}")


def write_config(path: str, *, endpoint: str, backends: list[str] | list[dict], policy: str = "round-robin",
                 extra: str = "") -> str:
    lines = ['schema = "npuserve-balancer/v1"', "[balancer]", f'endpoints = ["{endpoint}"]', f'policy = "{policy}"']
    lines.append(extra)
    for b in backends:
        b = {"endpoint": b} if isinstance(b, str) else b
        lines.append("[[backends]]")
        for k, v in b.items():
            lines.append(f"{k} = {v!r}".replace("'", '"') if isinstance(v, str) else f"{k} = {v}")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


def start_balancer(directory: str, n: int, *, backends: list, policy: str = "round-robin", extra_toml: str = "",
                   endpoint: str | None = None) -> BalancerProc:
    """Balancer number `n` of a test (its config and log in `directory`) on a tcp:// endpoint; not yet waited for."""
    endpoint = endpoint or tcp_endpoint()
    cfg = write_config(os.path.join(directory, f"bal{n}.toml"), endpoint=endpoint, backends=backends,
                       policy=policy, extra=extra_toml)
    log_path = os.path.join(directory, f"bal{n}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "engine.balancer.main", "--config", cfg], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return BalancerProc(proc, endpoint, directory, log_path, config_path=cfg)


def stop_and_check(balancers: list[BalancerProc]) -> list[str]:
    """Stop each (unless it exited) and return the exits that were not the expected one."""
    problems = []
    for b in balancers:
        rc = b.stop() if b.proc.poll() is None else b.proc.returncode
        if b.expect_exit is not None and rc != b.expect_exit:
            problems.append(f"balancer {b.pid} exited {rc}:\n{b.log()[-3000:]}")
    return problems


def tcp_daemon(daemon, **kw):
    """A daemon (the `daemon` fixture's factory) listening on a tcp:// endpoint too; returns (DaemonProc, tcp endpoint)."""
    ep = tcp_endpoint()
    d = daemon(extra=["--endpoint", ep] + list(kw.pop("extra", [])), **kw)
    return d, ep
