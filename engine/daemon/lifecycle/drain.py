"""The stop-signal drain, as a state machine of `now` (no clock, no signals: the loop feeds them).

SIGTERM (or SIGINT) while serving starts a drain: admission answers 503
`draining` (retryable, so a balancer sends the request elsewhere), requests
in flight keep running until they are all done or until the drain budget
(`server.drain_timeout_s`) is spent; then the daemon stops and the core ends
whatever is left with its one terminal event. A second stop signal during
the drain ends it at once, through the same shutdown path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DrainState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    STOPPING = "stopping"  # the loop ends at its next turn


class StopCause(enum.Enum):
    DRAINED = "drained"  # nothing was left in flight
    DEADLINE = "deadline"  # the drain budget ran out
    SECOND_SIGNAL = "second_signal"  # the operator insisted


class SignalOutcome(enum.Enum):
    BEGIN_DRAIN = "begin_drain"
    STOP_NOW = "stop_now"
    IGNORED = "ignored"  # already stopping


@dataclass
class Drain:
    state: DrainState = DrainState.SERVING
    started_at: float | None = None
    deadline: float | None = None
    cause: StopCause | None = None

    def on_stop_signal(self, now: float, budget_s: float) -> SignalOutcome:
        """A SIGTERM/SIGINT arrived: the first starts the drain, a second one ends it."""
        assert budget_s >= 0
        if self.state is DrainState.SERVING:
            self.state = DrainState.DRAINING
            self.started_at = now
            self.deadline = now + budget_s
            return SignalOutcome.BEGIN_DRAIN
        if self.state is DrainState.DRAINING:
            self._stop(StopCause.SECOND_SIGNAL)
            return SignalOutcome.STOP_NOW
        return SignalOutcome.IGNORED

    def check(self, now: float, in_flight: int) -> StopCause | None:
        """The cause to stop now (it stays once decided), or None to keep serving what is in flight."""
        if self.state is not DrainState.DRAINING:
            return self.cause
        assert self.deadline is not None and in_flight >= 0
        if in_flight == 0:
            self._stop(StopCause.DRAINED)
        elif now >= self.deadline:
            self._stop(StopCause.DEADLINE)
        return self.cause

    def remaining_s(self, now: float) -> float:
        """Drain budget left (0 when not draining)."""
        if self.state is not DrainState.DRAINING:
            return 0.0
        assert self.deadline is not None
        return max(0.0, self.deadline - now)

    @property
    def draining(self) -> bool:
        return self.state is DrainState.DRAINING

    def _stop(self, cause: StopCause) -> None:
        assert self.state is DrainState.DRAINING
        self.state = DrainState.STOPPING
        self.cause = cause
