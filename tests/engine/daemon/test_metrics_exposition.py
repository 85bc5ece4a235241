"""The /metrics exposition: one name per sample in the text format and in OpenMetrics, and its HTTP server."""

from __future__ import annotations

import gzip
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from engine.daemon.observability import exposition

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def _registry() -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("npuserve:requests", "c", ["reason"], registry=r).labels("length").inc(3)
    Gauge("npuserve:chip_up", "g", ["chip"], registry=r).labels("0").set(1)
    Histogram("npuserve:ttft_seconds", "h", buckets=(0.1, 1.0), registry=r).observe(0.5)
    return r


def _names(families) -> set[str]:
    """Sample names, without the *_created series (on or off per process: disable_created_metrics is global)."""
    return {s.name for f in families for s in f.samples if not s.name.endswith("_created")}


def test_both_formats_name_every_sample_as_registered():
    r = _registry()
    text, text_type = exposition.render([r], None)
    om, om_type = exposition.render([r], OPENMETRICS + ", text/plain;version=0.0.4;q=0.5")
    assert text_type.startswith("text/plain; version=0.0.4") and om_type.startswith("application/openmetrics-text")
    want = {"npuserve:requests_total", "npuserve:chip_up", "npuserve:ttft_seconds_bucket",
            "npuserve:ttft_seconds_count", "npuserve:ttft_seconds_sum"}
    assert _names(parse_text(text.decode())) == want
    assert _names(parse_openmetrics(om.decode())) == want
    assert b"npuserve_" not in om


def test_a_family_a_scraper_could_not_store_by_its_name_is_left_out():
    class Bad:
        def collect(self):
            yield GaugeMetricFamily("npuserve:ok", "kept", value=1)
            yield GaugeMetricFamily("npuserve:bad-name", "dropped", value=2)
            g = GaugeMetricFamily("npuserve:bad_label", "dropped", labels=["a-b"])
            g.add_metric(["x"], 1)
            yield g
    for accept in (None, OPENMETRICS):
        body, _ = exposition.render([Bad()], accept)
        assert b"npuserve:ok" in body and b"bad" not in body.replace(b"npuserve:ok", b"")


@pytest.fixture
def server():
    started = []

    def start(sources):
        http = exposition.serve("127.0.0.1", 0, sources)
        started.append(http)
        return f"http://127.0.0.1:{http.port}/metrics"
    yield start
    for http in started:
        http.close()


def _get(url: str, **headers) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_the_server_negotiates_the_format_and_gzip(server):
    url = server([_registry()])
    status, headers, body = _get(url)
    assert status == 200 and headers["Content-Type"] == exposition.TEXT_CONTENT_TYPE
    assert b"npuserve:chip_up{" in body
    status, headers, body = _get(url, Accept=OPENMETRICS, **{"Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Type"] == exposition.OPENMETRICS_CONTENT_TYPE
    assert headers["Content-Encoding"] == "gzip"
    om = gzip.decompress(body).decode()
    assert "npuserve:chip_up{" in om and om.endswith("# EOF\n")


def test_a_failing_collector_answers_500_and_the_server_keeps_serving(server):
    class Flaky:
        calls = 0

        def collect(self):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("boom")
            yield GaugeMetricFamily("npuserve:fine", "ok", value=1)
    url = server([Flaky()])
    assert _get(url)[0] == 500
    status, _, body = _get(url)
    assert status == 200 and b"npuserve:fine 1.0" in body
