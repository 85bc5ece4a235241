"""LoopHistogram exposes exactly what a prometheus_client Histogram fed the same values would."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from engine.daemon.observability.loop_histogram import LoopHistogram
from engine.daemon.observability.metrics import ITL_BUCKETS


def test_same_exposition_as_prometheus_client_histogram():
    rng = random.Random(3)
    values = [rng.choice((0.0, 0.01, 0.025, 1.0, 80.0, 81.0)) for _ in range(50)]  # exact bounds: le is inclusive
    values += [rng.expovariate(10.0) for _ in range(500)]
    ref_reg, reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("npuserve:x_seconds", "doc", ["model_name"], buckets=ITL_BUCKETS, registry=ref_reg)
    mine = LoopHistogram("npuserve:x_seconds", "doc", ["model_name"], ITL_BUCKETS, reg)
    for v in values:
        ref.labels("m").observe(v)
    mine.labels("m").observe_many(values[:300])
    for v in values[300:]:
        mine.labels("m").observe(v)
    ref.labels("other")  # a child that saw nothing
    mine.labels("other")

    def lines(r):
        return sorted(ln for ln in generate_latest(r).decode().splitlines()
                      if not ln.startswith("#") and "_created" not in ln and "_sum" not in ln)

    assert lines(reg) == lines(ref_reg)
    got = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in generate_latest(reg).decode().splitlines()
           if "_sum" in ln}
    assert abs(got['npuserve:x_seconds_sum{model_name="m"}'] - sum(values)) < 1e-9
    assert got['npuserve:x_seconds_sum{model_name="other"}'] == 0.0
