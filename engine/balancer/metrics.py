"""The balancer's Prometheus series (`npuserve:balancer_*`), served on `metrics.port` when it is set.

The balancer core is single-threaded; the /metrics server is another thread.
As at a board, the loop copies what the series show into an immutable
snapshot (plain tuples) at most every PUBLISH_INTERVAL_S and swaps it in by
one reference assignment; a scrape renders whichever snapshot is current and
never touches the core. Labels are bounded: `backend` (a configured
endpoint), `pool`, `role`, and `event` (the core's fixed counter names).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.daemon.observability import exposition
from engine.daemon.observability.metrics import PREFIX

if TYPE_CHECKING:
    from engine.balancer.core import BalancerCore

PUBLISH_INTERVAL_S = 0.5


class BalancerMetrics(Collector):
    def __init__(self) -> None:
        self._snapshot: tuple = ()
        self.next_publish = 0.0
        self._http: exposition.MetricsHttp | None = None

    def publish(self, core: "BalancerCore", now: float) -> None:
        """Loop thread: copy the core's figures into a new snapshot (at most every PUBLISH_INTERVAL_S)."""
        if now < self.next_publish:
            return
        self.next_publish = now + PUBLISH_INTERVAL_S
        live = [b for b in core.backends.values() if not b.removed]
        per_backend = tuple((b.name, b.spec.pool, b.spec.role, b.routable(), b.chips_up, len(b.inflight))
                            for b in live)
        self._snapshot = (per_backend, core.accepting, len(core._reqs), tuple(sorted(core.counters.items())),
                          tuple(sorted(core.routed.items())))

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot
        if not snap:
            return
        per_backend, accepting, inflight, counters, routed = snap
        up = GaugeMetricFamily(PREFIX + "balancer_backend_up", "1 while the backend is routable (heartbeats "
                               "answered, breaker closed, accepting, a chip up), by backend.",
                               labels=["backend", "pool", "role"])
        chips = GaugeMetricFamily(PREFIX + "balancer_backend_chips_up", "Chips up at the backend, as its last "
                                  "heartbeat said.", labels=["backend"])
        busy = GaugeMetricFamily(PREFIX + "balancer_backend_inflight", "This balancer's requests with an attempt "
                                 "at the backend.", labels=["backend"])
        for name, pool, role, routable, chips_up, n in per_backend:
            up.add_metric([name, pool, role], 1.0 if routable else 0.0)
            chips.add_metric([name], float(chips_up))
            busy.add_metric([name], float(n))
        yield up
        yield chips
        yield busy
        yield GaugeMetricFamily(PREFIX + "balancer_backends_up", "Routable backends (health's backends_up).",
                                value=float(sum(1 for b in per_backend if b[3])))
        yield GaugeMetricFamily(PREFIX + "balancer_backends_total", "Configured backends (health's "
                                "backends_total).", value=float(len(per_backend)))
        yield GaugeMetricFamily(PREFIX + "balancer_accepting", "1 while the balancer accepts new requests.",
                                value=1.0 if accepting else 0.0)
        yield GaugeMetricFamily(PREFIX + "balancer_requests_inflight", "Client requests in flight at the "
                                "balancer.", value=float(inflight))
        ev = CounterMetricFamily(PREFIX + "balancer_events", "What the balancer did, by event: requests, "
                                 "attempts, retries, migrations, no_backend, breaker_opened, backend_lost, "
                                 "failed, finished_<reason>, ...", labels=["event"])
        for k, v in counters:
            ev.add_metric([k], float(v))
        yield ev
        rt = CounterMetricFamily(PREFIX + "balancer_routed", "Attempts sent to each backend.", labels=["backend"])
        for k, v in routed:
            rt.add_metric([k], float(v))
        yield rt

    # -- HTTP ----------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> None:
        """Start the /metrics server thread. Raises OSError when host:port cannot be bound."""
        self._http = exposition.serve(host, port, [self])

    @property
    def port(self) -> int | None:
        return None if self._http is None else self._http.port

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None
