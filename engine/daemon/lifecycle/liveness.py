"""Loop-stall detection: is the scheduler loop itself still turning?

The loop marks when it wakes and when it goes back to sleep. A turn that has
been busy longer than the threshold is a stall; other threads (metrics,
watchdog) may call `stalled(now)` at any time, and the loop's own health
reply reports the longest recent turn, so a loop that stalled a moment ago is
still reported unhealthy for `window_s`.
"""

from __future__ import annotations

import collections


class LoopLiveness:
    def __init__(self, stall_threshold_s: float, window_s: float = 5.0) -> None:
        assert stall_threshold_s > 0 and window_s > 0
        self.stall_threshold_s = stall_threshold_s
        self.window_s = window_s
        self._busy_since: float | None = None
        self._recent: collections.deque[tuple[float, float]] = collections.deque()  # (end, duration) of long turns
        self.turns = 0
        self.max_turn_s = 0.0

    def woke(self, now: float) -> None:
        self._busy_since = now

    def sleeping(self, now: float) -> None:
        start = self._busy_since
        self._busy_since = None
        if start is None:
            return
        self.turns += 1
        d = now - start
        if d > self.max_turn_s:
            self.max_turn_s = d
        if d >= self.stall_threshold_s / 4:
            self._recent.append((now, d))
        while self._recent and now - self._recent[0][0] > self.window_s:
            self._recent.popleft()

    def stalled(self, now: float) -> bool:
        """True when the current turn has been running longer than the threshold."""
        start = self._busy_since
        return start is not None and now - start > self.stall_threshold_s

    def lag_s(self, now: float) -> float:
        """The longest turn in the recent window (the current one included)."""
        lag = max((d for end, d in self._recent if now - end <= self.window_s), default=0.0)
        if self._busy_since is not None:
            lag = max(lag, now - self._busy_since)
        return lag

    def healthy(self, now: float) -> bool:
        return self.lag_s(now) <= self.stall_threshold_s
