"""`Retry-After` on the HTTP front's 429/503: a real daemon, a real `npuserve http`, httpx. The header is the
upstream's retry_after_ms in whole seconds rounded up, on plain and streamed requests (the error comes before
the stream starts); the front's own 503 (upstream down) says when it looks again; a 400 has none."""

from __future__ import annotations

import math

import httpx
import pytest
from waiting import wait_until

from engine.core.retry_after import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S

pytestmark = pytest.mark.integration

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
MAX_S = math.ceil(RETRY_AFTER_MAX_S)


def retry_after(r: httpx.Response) -> int:
    assert "retry-after" in r.headers, (r.status_code, dict(r.headers), r.text)
    v = r.headers["retry-after"]
    assert v.isdigit(), v  # delta-seconds: a non-negative integer
    return int(v)


def test_429_queue_full_has_retry_after_plain_and_streamed(daemon, http_front):
    d = daemon(backend="stub", chips=1, settings={"admission.max_waiting_requests": 0})  # every request: 429
    front = http_front(d.endpoint)
    with httpx.Client(timeout=60) as h:
        r = h.post(front.url + "/v1/completions", json=BODY)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert math.ceil(RETRY_AFTER_MIN_S) <= retry_after(r) <= MAX_S
        r = h.post(front.url + "/v1/completions", json={**BODY, "stream": True})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert 1 <= retry_after(r) <= MAX_S
        r = h.post(front.url + "/v1/completions", json={**BODY, "max_tokens": 1 << 19})  # a 400: no header
        assert r.status_code == 400 and "retry-after" not in r.headers


def test_503_draining_has_retry_after_within_the_drain_and_503_upstream_down_has_one_too(daemon, http_front):
    d = daemon(backend="stub", chips=1)
    front = http_front(d.endpoint)  # http.health_interval_ms: its default, 1000
    timeout_ms = 40_000
    with d.client(timeout=20) as c, httpx.Client(timeout=60) as h:
        assert c.call("drain", timeout_ms=timeout_ms) == {"accepting": False}
        for stream in (False, True):
            r = h.post(front.url + "/v1/completions", json={**BODY, "stream": stream})
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            assert 1 <= retry_after(r) <= timeout_ms // 1000
        c.call("resume")
        assert h.post(front.url + "/v1/completions", json=BODY).status_code == 200
    assert d.stop() == 0
    wait_until(lambda: front.get("/health")[0] == 503, timeout=30, what="/health 503")
    with httpx.Client(timeout=60) as h:
        r = h.post(front.url + "/v1/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"
    assert retry_after(r) == 1  # the front looks at its upstream again within a health interval
