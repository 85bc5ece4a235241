"""One backend as the balancer sees it: configuration, heartbeat figures and a circuit breaker.

Sans-I/O: every transition takes `now`. The breaker:

    UNKNOWN --heartbeat--> UP --(missed heartbeats | disconnect | N failures)--> OUT
    OUT --(cooldown over and a heartbeat after the opening)--> HALF_OPEN
    HALF_OPEN --probe request streams or finishes--> UP
    HALF_OPEN --probe fails | disconnect | missed heartbeats--> OUT (cooldown doubled, capped)

`drained` (admin) and `removed` (SIGHUP reload) are flags beside the state:
such a backend gets no new request but keeps its in-flight ones.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Health(enum.Enum):
    UNKNOWN = "unknown"  # no heartbeat yet
    UP = "up"
    OUT = "out"  # circuit open
    HALF_OPEN = "half_open"  # one probe request allowed


@dataclass(frozen=True)
class BackendSpec:
    endpoint: str
    pool: str = "default"
    weight: float = 1.0
    role: str = "mixed"  # prefill/decode disaggregation (engine/balancer/pd_routing.py)


@dataclass(frozen=True)
class HealthPolicy:
    heartbeat_interval_s: float = 1.0
    missed_heartbeats: int = 3  # this many intervals without a reply: out
    stale_after_s: float = 2.0  # a load figure older than this counts as saturated
    failure_threshold: int = 3  # consecutive failed requests: out
    cooldown_s: float = 1.0  # first wait before a half-open probe
    max_cooldown_s: float = 30.0


@dataclass
class Backend:
    spec: BackendSpec
    health: Health = Health.UNKNOWN
    reason: str = "no heartbeat yet"
    drained: bool = False
    removed: bool = False
    last_reply: float | None = None  # time of the last heartbeat reply
    accepting: bool = False
    chips_up: int = 0
    others_load: int = 0  # requests on it that are not ours, at the last heartbeat
    reported: dict = field(default_factory=dict)  # the last health body
    inflight: set[int] = field(default_factory=set)  # our request ids with an attempt there
    failures: int = 0
    opened_at: float = 0.0
    cooldown_s: float = 0.0
    probe: int | None = None  # request id of the half-open probe
    next_heartbeat: float = 0.0
    rr_current: float = 0.0  # smooth weighted round-robin state
    picks: int = 0  # times chosen: the last tie-break, so equal backends take turns

    @property
    def name(self) -> str:
        return self.spec.endpoint

    def load(self) -> int:
        """Requests in flight there: ours now plus what the last heartbeat said of the others."""
        return len(self.inflight) + self.others_load

    def stale(self, now: float, policy: HealthPolicy) -> bool:
        return self.last_reply is None or now - self.last_reply > policy.stale_after_s

    def routable(self) -> bool:
        if self.drained or self.removed or not self.accepting or self.chips_up <= 0:
            return False
        if self.health is Health.UP:
            return True
        return self.health is Health.HALF_OPEN and self.probe is None

    def ready_in(self, now: float, policy: HealthPolicy) -> float | None:
        """Seconds until this backend may take a request again, as far as the balancer can tell (a retry
        estimate); None when only an operator brings it back (drained by an admin, removed)."""
        if self.drained or self.removed:
            return None
        if self.routable():
            return 0.0
        if self.health is Health.OUT:  # the cooldown, then a heartbeat that lets it probe again
            return max(0.0, self.opened_at + self.cooldown_s - now) + policy.heartbeat_interval_s
        return policy.heartbeat_interval_s  # not heard yet, not accepting, no chip up: its next heartbeat may say

    # -- transitions ---------------------------------------------------------------
    def on_heartbeat(self, body: dict, now: float, policy: HealthPolicy) -> None:
        self.last_reply = now
        self.reported = body
        self.accepting = bool(body.get("accepting", body.get("ok", False)))
        self.chips_up = int(body.get("chips_up") or 0)
        active = body.get("active_requests")
        self.others_load = max(0, int(active) - len(self.inflight)) if isinstance(active, int) else 0
        if self.health is Health.UNKNOWN:
            self._to(Health.UP, "heartbeat")
        elif self.health is Health.OUT and now - self.opened_at >= self.cooldown_s:
            self._to(Health.HALF_OPEN, "heartbeat after cooldown; waiting for a probe request")

    def check_heartbeat(self, now: float, policy: HealthPolicy) -> bool:
        """Take the backend out when it missed its heartbeats; True when that happened now."""
        if self.health in (Health.UP, Health.HALF_OPEN) and self.last_reply is not None:
            limit = policy.missed_heartbeats * policy.heartbeat_interval_s
            if now - self.last_reply > limit:
                self.open(f"missed heartbeats ({now - self.last_reply:.1f} s without a reply)", now, policy)
                return True
        return False

    def on_success(self) -> None:
        self.failures = 0
        if self.health is Health.HALF_OPEN:
            self.probe = None
            self.cooldown_s = 0.0
            self._to(Health.UP, "probe request succeeded")

    def on_failure(self, why: str, now: float, policy: HealthPolicy) -> bool:
        """A request failed there (5xx, send failure). True when the breaker opened now."""
        self.failures += 1
        if self.health is Health.HALF_OPEN or (self.health is Health.UP and self.failures >= policy.failure_threshold):
            self.open(f"{self.failures} consecutive failures, last: {why}", now, policy)
            return True
        return False

    def open(self, why: str, now: float, policy: HealthPolicy) -> None:
        was_probing = self.health is Health.HALF_OPEN
        self.probe = None
        self.opened_at = now
        if was_probing:
            self.cooldown_s = min(policy.max_cooldown_s, max(policy.cooldown_s, self.cooldown_s * 2))
        else:
            self.cooldown_s = policy.cooldown_s
        self.accepting = False
        self._to(Health.OUT, why)

    def _to(self, health: Health, why: str) -> None:
        assert health is not self.health or health is Health.OUT, (self.health, health)
        self.health = health
        self.reason = why

    def snapshot(self, now: float, policy: HealthPolicy) -> dict:
        model = self.reported.get("model") if isinstance(self.reported.get("model"), dict) else None
        return {
            "endpoint": self.name, "pool": self.spec.pool, "weight": self.spec.weight, "role": self.spec.role,
            "state": self.health.value, "reason": self.reason, "routable": self.routable(),
            "drained": self.drained, "removed": self.removed, "accepting": self.accepting,
            "chips_up": self.chips_up, "load": self.load(), "inflight": len(self.inflight),
            "stale": self.stale(now, policy),
            "heartbeat_age_s": None if self.last_reply is None else round(now - self.last_reply, 3),
            "model": None if model is None else model.get("alias"),
            "reported_load": self.reported.get("load"),
        }
