"""Does ping/pong pay on this chip now: delivered tokens/s with two jobs in flight against one.

Two jobs in flight only help when one job leaves the chip idle (the host
side of a step: inputs, launch, results). When it does not, splitting the
ready lanes over two jobs makes each batch smaller and the chip slower
(about 6 % on the simulator with no host side). So the probe measures both:
a window of `window` delivered tokens at the configured limit, then one at
one in flight, and keeps ping/pong only when it delivered at least
`1 + min_gain` times the one-in-flight rate. A verdict for ping/pong holds
for `hold` windows, one against it for `hold_against` (short: a verdict
taken while the load was changing is soon taken again); then both are
measured again (the load may have changed). Each verdict that repeats the
one before doubles its hold (up to `max_hold`), so a chip spends a
shrinking share of its time at the losing limit.

The first `warmup` tokens of a chip (the first prompts' start) and the
first `settle` tokens after each switch (jobs launched under the old limit
still draining) are not counted. Plain data, no clock: the caller
passes the time of each delivery.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.Enum):
    MULTI = "measuring_pingpong"
    SINGLE = "measuring_one_in_flight"
    HOLD_MULTI = "pingpong_pays"
    HOLD_SINGLE = "pingpong_does_not_pay"


@dataclass
class PingPongProbe:
    min_gain: float = 0.10  # ping/pong must deliver this much more than one in flight to stay on
    window: int = 1024  # delivered tokens per measuring window
    settle: int = 64  # tokens after a switch that are not counted
    hold: int = 16  # windows a verdict for ping/pong holds before measuring again (doubled while it repeats)
    hold_against: int = 2  # the same for a verdict against it
    max_hold: int = 256
    warmup: int | None = None  # tokens not counted at the start (None: one window)
    phase: Phase = Phase.MULTI
    rate_multi: float | None = None  # tokens/s of the last window at the configured limit
    rate_single: float | None = None  # tokens/s of the last window at one in flight
    verdicts_against: int = 0  # verdicts against ping/pong in a row
    verdicts_for: int = 0  # verdicts for it in a row
    _hold_now: int = 0
    _skip: int = 64
    _count: int = 0
    _t0: float | None = None
    _left: int = 0  # tokens left in the current hold

    def __post_init__(self) -> None:
        self._skip = self.window if self.warmup is None else self.warmup

    def single(self) -> bool:
        """One job in flight now (measuring it, or ping/pong did not pay)."""
        return self.phase in (Phase.SINGLE, Phase.HOLD_SINGLE)

    def on_tokens(self, now: float, n: int) -> bool:
        """`n` tokens delivered at `now` on this chip; True when the limit changed (single() flipped)."""
        if n <= 0:
            return False
        before = self.single()
        if self.phase in (Phase.HOLD_MULTI, Phase.HOLD_SINGLE):
            self._left -= n
            if self._left <= 0:
                self._start(Phase.MULTI)
            return self.single() != before
        if self._skip > 0:
            self._skip -= n
            return False
        if self._t0 is None:  # the window's clock starts at its first counted delivery
            self._t0 = now
            return False
        self._count += n
        if self._count < self.window:
            return False
        rate = self._count / max(now - self._t0, 1e-9)
        if self.phase is Phase.MULTI:
            self.rate_multi = rate
            self._start(Phase.SINGLE)
        else:
            self.rate_single = rate
            self._decide()
        return self.single() != before

    def _start(self, phase: Phase) -> None:
        self.phase = phase
        self._skip, self._count, self._t0 = self.settle, 0, None

    def _decide(self) -> None:
        pays = self.rate_multi is not None and self.rate_single is not None and \
            self.rate_multi >= (1.0 + self.min_gain) * self.rate_single
        if pays:
            self.verdicts_against, self.verdicts_for = 0, self.verdicts_for + 1
            self.phase, streak, base = Phase.HOLD_MULTI, self.verdicts_for, self.hold
        else:
            self.verdicts_against, self.verdicts_for = self.verdicts_against + 1, 0
            self.phase, streak, base = Phase.HOLD_SINGLE, self.verdicts_against, self.hold_against
        hold = min(self.max_hold, base * 2 ** min(streak - 1, 16))
        self._hold_now = hold
        self._left = hold * self.window

    def reset(self) -> None:
        self.rate_multi = self.rate_single = None
        self.verdicts_against = self.verdicts_for = 0
        self._start(Phase.MULTI)

    def gain(self) -> float | None:
        """Ping/pong's tokens/s over one in flight, from the last pair of windows."""
        if not self.rate_multi or not self.rate_single:
            return None
        return self.rate_multi / self.rate_single

    def stats(self) -> dict:
        g = self.gain()
        return {"phase": self.phase.value, "tokens_per_s_pingpong": self.rate_multi,
                "tokens_per_s_one_in_flight": self.rate_single, "gain": None if g is None else round(g, 4),
                "min_gain": self.min_gain, "verdicts_against": self.verdicts_against, "verdicts_for": self.verdicts_for,
                "hold_windows": self._hold_now}
