"""Worker supervision: when a chip's worker counts as failed, and whether it may be restarted.

Pure bookkeeping over an injected clock so that the rules (heartbeat timeout,
start-up timeout, restart rate limit) are testable without processes; the
event loop feeds it observations and carries out its decisions.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field

RATE_WINDOW_S = 600.0  # max_resets_per_10min counts restarts in this sliding window


class ChipState(enum.Enum):
    STARTING = "starting"  # first start, waiting for READY
    UP = "up"  # in service
    RESTARTING = "restarting"  # restarted after a failure, waiting for READY
    OUT = "out"  # restart budget exhausted: out of service until the daemon restarts


class Decision(enum.Enum):
    RESTART = "restart"
    TAKE_OUT = "take_out"


@dataclass
class ChipRecord:
    chip: int
    state: ChipState = ChipState.STARTING
    since: float = 0.0  # when the current state began
    restarts: collections.deque = field(default_factory=collections.deque)  # restart times in the window
    total_restarts: int = 0
    last_failure: str = ""


class Supervisor:
    """Decides on worker failures; the loop calls `check` every supervision tick."""

    def __init__(self, chips: int, *, max_resets_per_10min: int, heartbeat_timeout_s: float,
                 startup_timeout_s: float, now: float) -> None:
        assert chips >= 1 and max_resets_per_10min >= 0
        assert heartbeat_timeout_s > 0 and startup_timeout_s > 0
        self.max_resets = max_resets_per_10min
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.chips = [ChipRecord(c, since=now) for c in range(chips)]

    def state(self, chip: int) -> ChipState:
        return self.chips[chip].state

    def in_service(self) -> list[int]:
        return [r.chip for r in self.chips if r.state is ChipState.UP]

    def all_out(self) -> bool:
        return all(r.state is ChipState.OUT for r in self.chips)

    def check(self, chip: int, *, alive: bool, last_heartbeat: float, now: float) -> str | None:
        """The failure reason when `chip` must be treated as failed now, else None."""
        r = self.chips[chip]
        if r.state is ChipState.OUT:
            return None
        if not alive:
            return "worker process died"
        if r.state is ChipState.UP:
            silent = now - last_heartbeat
            if silent > self.heartbeat_timeout_s:
                return f"no heartbeat for {silent * 1000:.0f} ms"
        elif now - r.since > self.startup_timeout_s:
            return f"not ready within {self.startup_timeout_s:.0f} s"
        return None

    def on_ready(self, chip: int, now: float) -> None:
        r = self.chips[chip]
        assert r.state in (ChipState.STARTING, ChipState.RESTARTING), r.state
        r.state, r.since = ChipState.UP, now

    def on_failure(self, chip: int, reason: str, now: float) -> Decision:
        """Record a failure; RESTART when the rate limit allows one more restart, else TAKE_OUT."""
        r = self.chips[chip]
        assert r.state is not ChipState.OUT
        r.last_failure = reason
        while r.restarts and now - r.restarts[0] >= RATE_WINDOW_S:
            r.restarts.popleft()
        if len(r.restarts) >= self.max_resets:
            r.state, r.since = ChipState.OUT, now
            return Decision.TAKE_OUT
        r.restarts.append(now)
        r.total_restarts += 1
        r.state, r.since = ChipState.RESTARTING, now
        return Decision.RESTART

    def take_out(self, chip: int, reason: str, now: float) -> None:
        """Out of service at once (the restart itself failed)."""
        r = self.chips[chip]
        r.last_failure = reason
        r.state, r.since = ChipState.OUT, now

    def snapshot(self, now: float) -> list[dict]:
        return [
            {
                "chip": r.chip,
                "state": r.state.value,
                "since_s": round(now - r.since, 3),
                "restarts_10min": sum(1 for t in r.restarts if now - t < RATE_WINDOW_S),
                "restarts_total": r.total_restarts,
                "last_failure": r.last_failure,
            }
            for r in self.chips
        ]
