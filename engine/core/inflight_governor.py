"""How many jobs a chip may hold in flight now: ping/pong, and its automatic downgrade.

With `executor.max_inflight = 2` a chip holds two batches with disjoint lanes,
each with its own ring records and KV transaction. When that goes wrong in a
way the second job may have caused, the chip drops back to one job in flight
(new jobs only; those already submitted drain) until an operator re-enables
it (the `reenable_inflight` admin op):

* crosstalk: a result that does not match its job (generation, kind or lane
  count), i.e. one job's answer may have been read for another's;
* a status anomaly: a job answered FAILED or INVALID;
* repeated timeouts: `timeouts` jobs timed out since the last re-enable;
* TPOT P99 regression: the P99 of the inter-token intervals while more than
  one job was allowed passes `tpot_regression` x the P99 of the last window
  at one job in flight. The first `window` intervals of a chip are taken at
  one in flight for that baseline (only when the check is on).

Apart from those faults, ping/pong must pay for itself (`min_gain` > 0): the
chip's delivered tokens/s with two jobs in flight against one, measured in
turns (`PingPongProbe`); while it does not pay the chip runs one job in
flight, and measures again later. That is not a downgrade (no notice, no
operator): it follows the load by itself.

Plain data, no clock: the scheduler feeds it events and intervals.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from engine.core.pingpong_probe import PingPongProbe


class DowngradeReason(enum.Enum):
    CROSSTALK = "crosstalk"
    STATUS = "status_anomaly"
    TIMEOUTS = "repeated_timeouts"
    TPOT = "tpot_regression"


@dataclass(frozen=True)
class GovernorPolicy:
    max_inflight: int = 1
    timeouts: int = 2  # job timeouts (since the last re-enable) that downgrade; 0 = never for timeouts
    tpot_regression: float = 0.0  # P99 ratio against the one-in-flight window that downgrades; 0 = off
    window: int = 256  # inter-token intervals per window
    min_gain: float = 0.0  # ping/pong's tokens/s over one in flight needed to stay on; 0 = not measured
    gain_window: int = 1024  # delivered tokens per measuring window of that check


def p99(xs) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))] if s else 0.0


@dataclass
class InflightGovernor:
    policy: GovernorPolicy
    downgraded: DowngradeReason | None = None
    timeouts: int = 0
    downgrades: int = 0
    baseline_p99: float | None = None  # the last one-in-flight window's TPOT P99
    _window: deque = field(default_factory=deque)
    _window_single: bool = True  # the window being filled is at one in flight
    probe: PingPongProbe | None = None  # does ping/pong pay (policy.min_gain > 0 with ping/pong)

    def __post_init__(self) -> None:
        # the baseline window comes first, at one in flight, when the TPOT check is on
        self._window_single = self.policy.tpot_regression > 0 and self.policy.max_inflight > 1
        if self.policy.min_gain > 0 and self.policy.max_inflight > 1:
            self.probe = PingPongProbe(min_gain=self.policy.min_gain, window=self.policy.gain_window,
                                       settle=max(1, self.policy.gain_window // 16))

    def limit(self) -> int:
        if self.downgraded is not None or self._window_single or (self.probe is not None and self.probe.single()):
            return 1
        return self.policy.max_inflight

    def on_tokens(self, now: float, n: int) -> bool:
        """`n` tokens delivered on this chip at `now`; True when ping/pong was switched on or off by its gain."""
        if self.probe is None or self.downgraded is not None or self._window_single:
            return False
        return self.probe.on_tokens(now, n)

    @property
    def pingpong(self) -> bool:
        return self.policy.max_inflight > 1

    def _downgrade(self, reason: DowngradeReason) -> bool:
        """True when this event downgraded the chip (it was running more than one in flight)."""
        if not self.pingpong or self.downgraded is not None:
            return False
        self.downgraded = reason
        self.downgrades += 1
        return True

    def on_crosstalk(self) -> bool:
        return self._downgrade(DowngradeReason.CROSSTALK)

    def on_status_anomaly(self) -> bool:
        return self._downgrade(DowngradeReason.STATUS)

    def on_timeout(self) -> bool:
        self.timeouts += 1
        n = self.policy.timeouts
        return n > 0 and self.timeouts >= n and self._downgrade(DowngradeReason.TIMEOUTS)

    def on_interval(self, seconds: float) -> bool:
        """One inter-token interval of a lane on this chip; True when it completed a window that downgrades."""
        pol = self.policy
        if pol.tpot_regression <= 0 or not self.pingpong or self.downgraded is not None:
            return False
        w = self._window
        w.append(seconds)
        if len(w) < pol.window:
            return False
        value = p99(w)
        w.clear()
        if self._window_single:
            self.baseline_p99 = value
            self._window_single = False
            return False
        if self.baseline_p99 and value > pol.tpot_regression * self.baseline_p99:
            return self._downgrade(DowngradeReason.TPOT)
        return False

    def reenable(self) -> bool:
        """The operator's re-enable: back to the configured limit; True when the chip was downgraded."""
        was = self.downgraded is not None
        self.downgraded = None
        self.timeouts = 0
        self._window.clear()
        self._window_single = self.policy.tpot_regression > 0 and self.pingpong
        if self.probe is not None:
            self.probe.reset()
        return was

    def stats(self) -> dict:
        return {"limit": self.limit(), "configured": self.policy.max_inflight,
                "downgraded": None if self.downgraded is None else self.downgraded.value,
                "downgrades": self.downgrades, "timeouts": self.timeouts, "baseline_tpot_p99_s": self.baseline_p99,
                **({} if self.probe is None else {"pingpong_gain": self.probe.stats()})}
