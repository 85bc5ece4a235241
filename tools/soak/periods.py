"""How long a soak runs and how often it switches or faults: a duration, or a count of requests.

`parse_duration`: `30s`, `10m`, `24h`, `250ms`, or plain seconds. `parse_every`
also takes `400req`: that many requests finished since the previous switch or
fault ended (counts make a short run the same on a fast and a slow machine).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"duration {text!r}: expected e.g. 30s, 10m, 24h")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


@dataclass(frozen=True)
class Every:
    seconds: float | None = None
    requests: int | None = None

    def due(self, since_t: float, since_requests: int, now: float, requests: int) -> bool:
        if self.seconds is not None:
            return now - since_t >= self.seconds
        return requests - since_requests >= (self.requests or 0)

    def __str__(self) -> str:
        return f"{self.requests} requests" if self.requests is not None else f"{self.seconds:g} s"


def parse_every(text: str) -> Every:
    m = re.fullmatch(r"\s*(\d+)\s*req(uests?)?\s*", text)
    if m:
        if int(m.group(1)) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: at least 1 request")
        return Every(requests=int(m.group(1)))
    s = parse_duration(text)
    if s <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return Every(seconds=s)
