"""A Prometheus histogram the loop thread observes without locks: for figures of every generated token.

prometheus_client's Histogram takes a lock, checks observability and walks
its buckets for each `observe()` (~2-3 us): per generated token (the
inter-token latency) that was one of the daemon's larger per-token costs. A
`LoopHistogram` child keeps its bucket counts and sum in one Python list that
only the loop thread writes (`observe_many` takes a whole loop turn's values:
a `bisect` per value), and the family is a registry collector whose
`collect()` (the HTTP thread, or the stats op on the loop thread) copies that
list in one step. A scrape that lands between the loop thread's bucket and
sum updates sees the sum one turn behind the counts; the counts themselves
(and so `_count` and every `_bucket`) are always consistent.

The exposition is prometheus_client's: `NAME_bucket{le=...}` (cumulative,
`le` as Python's repr of the float bound, as prometheus_client prints it),
`NAME_count`, `NAME_sum`, with the same label names.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class LoopHistogramChild:
    """One label set: counts[i] for bucket i (the last, +Inf), then the sum, in one list."""

    __slots__ = ("bounds", "counts")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts: list[float] = [0] * (len(bounds) + 1) + [0.0]

    def observe(self, value: float) -> None:
        c = self.counts
        c[bisect_left(self.bounds, value)] += 1  # the first bound >= value (le is inclusive); past all: +Inf
        c[-1] += value

    def observe_many(self, values: Sequence[float]) -> None:
        if not values:
            return
        c, bounds = self.counts, self.bounds
        for v in values:
            c[bisect_left(bounds, v)] += 1
        c[-1] += sum(values)


class LoopHistogram(Collector):
    """A histogram family (`labels(...)` children) registered in `registry` as a collector of its own."""

    def __init__(self, name: str, doc: str, labelnames: Iterable[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.doc = doc
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self._les = tuple(repr(b) for b in self.bounds) + ("+Inf",)
        self._children: dict[tuple[str, ...], LoopHistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> LoopHistogramChild:
        assert len(values) == len(self.labelnames), (values, self.labelnames)
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = LoopHistogramChild(self.bounds)
        return child

    def collect(self) -> Iterator[Metric]:
        h = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        for key, child in list(self._children.items()):
            snap = list(child.counts)  # one copy: counts consistent with each other
            cum, rows = 0, []
            for le, n in zip(self._les, snap):
                cum += n
                rows.append((le, cum))
            h.add_metric(key, rows, snap[-1])
        yield h
