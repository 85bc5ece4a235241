"""retry_after_ms over the wire from a real daemon: a 429 queue_full, a 503 draining and a 503 model_unavailable
say when to come back (within the clamp; a drain within its time left; no model: the restart estimate), the client
library exposes it, and a non-retryable error carries none."""

from __future__ import annotations

import pytest

from engine.core.retry_after import NOT_READY_RETRY_S, RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S
from engine.errors import InvalidRequest, Overloaded, Unavailable

pytestmark = pytest.mark.integration

MIN_MS, MAX_MS = round(RETRY_AFTER_MIN_S * 1000), round(RETRY_AFTER_MAX_S * 1000)


def test_queue_full_429_carries_retry_after_ms_in_range(daemon):
    # no room to wait at all: every request is refused with 429 queue_full at submit, whatever the timing
    d = daemon(backend="stub", chips=1, settings={"admission.max_waiting_requests": 0})
    with d.client(timeout=20) as c:
        with pytest.raises(Overloaded) as e:
            c.generate([1, 2, 3], max_tokens=4)
        err = e.value
        assert (err.code, err.reason, err.retryable) == (429, "queue_full", True)
        assert type(err.retry_after_ms) is int and MIN_MS <= err.retry_after_ms <= MAX_MS
        assert "retry_after_ms" not in err.details
        with pytest.raises(InvalidRequest) as e:  # non-retryable (the server's 400): no estimate
            c.generate([1, 2, 3], max_tokens=1 << 19)
        assert (e.value.reason, e.value.retryable, e.value.retry_after_ms) == ("context_too_long", False, None)
        assert c.health()["ok"] is True  # and it keeps serving


def test_admin_drain_503_carries_the_time_left_of_the_drain(daemon):
    d = daemon(backend="stub", chips=1)
    timeout_ms = 600_000  # longer than the clamp: the answer is the clamp's longest wait
    with d.client(timeout=20) as c:
        assert c.call("drain", timeout_ms=timeout_ms) == {"accepting": False}
        with pytest.raises(Unavailable) as e:
            c.generate([1, 2], max_tokens=2)
        assert (e.value.code, e.value.reason, e.value.retryable) == (503, "draining", True)
        assert e.value.retry_after_ms == MAX_MS
        c.call("resume")
        timeout_ms = 40_000
        assert c.call("drain", timeout_ms=timeout_ms) == {"accepting": False}
        with pytest.raises(Unavailable) as e:
            c.generate([1, 2], max_tokens=2)
        # the time left: at most the drain timeout, and not the clamp's longest wait (that is after the deadline)
        assert e.value.reason == "draining" and MIN_MS <= e.value.retry_after_ms <= timeout_ms
        c.call("resume")
        assert c.generate([1, 2], max_tokens=2).finish_reason == "length"


def test_no_model_loaded_503_carries_the_restart_estimate(daemon):
    d = daemon(backend="stub", chips=1)
    with d.client(timeout=20) as c:
        assert c.call("unload", alias="tiny")["model"]["state"] == "unloaded"
        with pytest.raises(Unavailable) as e:
            c.generate([1, 2], max_tokens=2)
        assert (e.value.code, e.value.reason, e.value.retryable) == (503, "model_unavailable", True)
        assert e.value.retry_after_ms == round(NOT_READY_RETRY_S * 1000)
