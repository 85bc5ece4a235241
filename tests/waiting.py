"""Waiting for a state, never for a time: polls whose deadline is only a hang guard, and reading process logs."""

from __future__ import annotations

import time


def wait_until(pred, timeout: float = 60.0, interval: float = 0.01, what: str = "the condition") -> None:
    """Poll `pred()` until it holds; the deadline is a hang guard only (generous for a machine three times
    slower than a loaded 2-core one), never what a test measures."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        time.sleep(interval)


def read_log(path: str) -> str:
    """A process's captured output so far ("" before it wrote any)."""
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


def log_events(text: str) -> list[dict]:
    """The JSON log lines of a daemon's output (banner and other lines skipped)."""
    import orjson

    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(orjson.loads(line))
    return out


def wait_for_log(d, event: str, timeout: float = 30.0, count: int = 1) -> list[dict]:
    """Poll the daemon's (a DaemonProc's) log until `count` lines of `event` are there; returns them."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in log_events(d.log()) if e.get("event") == event]
        if len(found) >= count:
            return found
        if time.monotonic() > deadline or d.proc.poll() is not None and len(found) < count:
            raise AssertionError(f"no {event!r} log line within {timeout} s:\n{d.log()[-3000:]}")
        time.sleep(0.05)
