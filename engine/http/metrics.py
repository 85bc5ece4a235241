"""The front's own Prometheus figures, and /metrics = those beside the upstream's.

The front's series are `npuserve:http_*` (requests by endpoint and status,
request latency, time to first token as the HTTP client sees it, and the
front's own share of it). The upstream's families come from its `stats` op
(`metrics`: what the daemon's own /metrics would show) and are rendered by
prometheus_client too, so one scrape of the front shows both.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from engine.daemon.observability import exposition
from engine.daemon.observability.metrics import PREFIX, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

# The front's added TTFT is meant to be ~1 ms: finer buckets than the daemon's.
ADDED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class HttpMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series only add noise to every scrape (as the daemon's)
        r = self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "http_requests", "HTTP requests answered by the front, by endpoint and "
                                "status code.", ["endpoint", "status"], registry=r)
        self.latency = Histogram(PREFIX + "http_request_duration_seconds", "HTTP request duration at the front "
                                 "(to the last byte), by endpoint.", ["endpoint"], buckets=REQUEST_LATENCY_BUCKETS,
                                 registry=r)
        self.ttft = Histogram(PREFIX + "http_time_to_first_token_seconds", "Time from the HTTP request's arrival "
                              "to its first tokens coming from the upstream (single-prompt streams).",
                              buckets=TTFT_BUCKETS, registry=r)
        self.added_ttft = Histogram(PREFIX + "http_added_ttft_seconds", "The front's share of a stream's TTFT: "
                                    "its TTFT minus the upstream's (ttft_ms of `done`).", buckets=ADDED_BUCKETS,
                                    registry=r)
        self.in_flight = Gauge(PREFIX + "http_requests_in_flight", "Generation requests being served by the "
                               "front.", registry=r)
        self.disconnects = Counter(PREFIX + "http_client_disconnects", "Requests whose HTTP client went away "
                                   "before the end (cancelled upstream).", registry=r)
        self._children: dict[tuple[str, int], object] = {}

    def count(self, endpoint: str, status: int) -> None:
        child = self._children.get((endpoint, status))
        if child is None:
            child = self._children[(endpoint, status)] = self.requests.labels(endpoint, str(status))
        child.inc()

    def exposition(self, upstream_families: list[dict] | None, accept: str | None = None) -> tuple[bytes, str]:
        """Our series, then the upstream's (the families of its `stats` reply), in the format `accept` asks
        for (text unless it names OpenMetrics): (body, Content-Type)."""
        sources = [self.registry]
        if upstream_families:
            sources.append(_FamiliesCollector(upstream_families))
        return exposition.render(sources, accept)


class _FamiliesCollector(Collector):
    """Metric families given as plain data (`{"name","type","help","samples":[[name, labels, value]]}`)."""

    def __init__(self, families: list[dict]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for f in self.families:
            try:
                m = Metric(str(f["name"]), str(f.get("help", "")), str(f.get("type", "untyped")))
                for name, labels, value in f.get("samples") or []:
                    m.add_sample(str(name), {str(k): str(v) for k, v in (labels or {}).items()}, float(value))
            except (KeyError, TypeError, ValueError):
                continue  # a family we cannot read is left out, not the whole scrape
            yield m
