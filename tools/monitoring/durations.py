"""Prometheus durations (`90s`, `5m`, `1h30m`) to seconds and back, for the flags and the files."""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_PART = re.compile(r"(\d+)(ms|s|m|h|d|w)")


def parse_seconds(text: str) -> float:
    """`1h30m` -> 5400.0. Raises ValueError for anything Prometheus would not read as a duration."""
    t = text.strip()
    if t == "0":
        return 0.0
    pos, total = 0, 0.0
    for m in _PART.finditer(t):
        if m.start() != pos:
            break
        total += int(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(t) or not t:
        raise ValueError(f"{text!r} is not a duration like 30s, 5m, 1h")
    return total


def render_seconds(seconds: float) -> str:
    """5400 -> `1h30m`; whole milliseconds below a second."""
    ms = round(seconds * 1000)
    if ms == 0:
        return "0s"
    out = ""
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        if ms >= size:
            out += f"{ms // size}{unit}"
            ms %= size
    return out
