"""How busy each chip is kept: its busy fraction per window, from the worker's own device times.

Overlap of host and device work is proven from data, not assumed: the worker
reports, with every result, when its backend call began and how long the chip
sat idle since the previous call ended (`JobResult.device_start_ns`,
`idle_us`). The metrics recorder feeds each result here; every publish reads
the busy fraction of the window since the previous read (device time of the
results that arrived in it over the window's length), so a chip the scheduler
keeps waiting shows below 1 while it has work.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChipOccupancy:
    """Per (model alias, chip): device seconds since the last window read, and the window's start."""

    busy_s: dict[tuple[str, int], float] = field(default_factory=dict)
    window_start: float | None = None
    last: dict[tuple[str, int], float] = field(default_factory=dict)  # the fractions of the last full window

    def observe(self, key: tuple[str, int], device_us: int) -> None:
        self.busy_s[key] = self.busy_s.get(key, 0.0) + device_us / 1e6

    def window(self, now: float) -> dict[tuple[str, int], float]:
        """Busy fraction of each chip since the previous call (the last window's figures for a chip seen before;
        0 for a chip with no result in this window)."""
        start, self.window_start = self.window_start, now
        if start is None or now <= start:
            return dict(self.last)
        span = now - start
        out = {k: 0.0 for k in self.last}
        for k, s in self.busy_s.items():
            out[k] = min(1.0, s / span)
        self.busy_s = {}
        self.last = out
        return dict(out)
