"""The balancer's /metrics: its config key and flag, and the series a scrape renders from the loop's snapshot."""

from __future__ import annotations

import random

import pytest

from engine.balancer.core import BalancerCore
from engine.balancer.metrics import PUBLISH_INTERVAL_S, BalancerMetrics
from engine.balancer.settings import load_settings
from engine.config_schema import ConfigError

CONF = '[balancer]\nendpoints = ["tcp://127.0.0.1:1"]\n[metrics]\nport = 9390\n[[backends]]\nendpoint = "tcp://h:2"\n'


def test_metrics_port_from_the_file_and_the_flag(tmp_path):
    p = tmp_path / "b.toml"
    p.write_text(CONF)
    assert load_settings(str(p)).metrics.port == 9390
    assert load_settings(str(p), metrics_port=9999).metrics.port == 9999
    assert load_settings(None, endpoints=["tcp://127.0.0.1:1"], backends=["tcp://h:2"]).metrics.port == 0
    with pytest.raises(ConfigError, match="metrics.port"):
        p.write_text(CONF.replace("9390", "70000"))
        load_settings(str(p))


def _samples(m: BalancerMetrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in m.collect() for s in f.samples}


def test_a_scrape_shows_the_snapshot_the_loop_published():
    s = load_settings(None, endpoints=["tcp://127.0.0.1:1"], backends=["tcp://h:2", "tcp://h:3"])
    core = BalancerCore(s.core_config(), s.backend_specs(), 0.0, random.Random(0))
    m = BalancerMetrics()
    assert _samples(m) == {}  # nothing published yet: nothing rendered
    m.publish(core, 0.0)
    got = _samples(m)
    assert got[("npuserve:balancer_backends_total", ())] == 2
    assert got[("npuserve:balancer_backends_up", ())] == 0  # no heartbeat answered yet
    assert got[("npuserve:balancer_backend_up", (("backend", "tcp://h:2"), ("pool", "default"),
                                                 ("role", "mixed")))] == 0
    assert got[("npuserve:balancer_accepting", ())] == 1
    core.drain(0.1, None)
    m.publish(core, 0.1)  # within the publish interval: the snapshot stays
    assert _samples(m)[("npuserve:balancer_accepting", ())] == 1
    m.publish(core, PUBLISH_INTERVAL_S)
    assert _samples(m)[("npuserve:balancer_accepting", ())] == 0
