"""Stopping a server a load tool started (SIGTERM, then SIGKILL) and reading the end of its log."""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM, wait up to `timeout`, SIGKILL if it did not exit; the exit status (negative = signal)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@dataclass
class Child:
    """A server process a tool started (a front, a balancer), writing its output to `log_path`."""

    proc: subprocess.Popen
    log_path: str

    def log_tail(self, n: int = 3000) -> str:
        return log_tail(self.log_path, n)

    def stop(self, timeout: float = 30.0) -> int:
        return stop(self.proc, timeout)


def log_tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()[-n:]
    except FileNotFoundError:
        return ""
