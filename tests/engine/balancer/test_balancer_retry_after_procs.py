"""retry_after_ms through a real balancer: when every backend is full, the client gets the backends' 429 with
their estimate kept; the balancer's own 503 draining carries its own."""

from __future__ import annotations

import pytest
from balancer_procs import tcp_daemon

from engine.core.retry_after import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S
from engine.errors import Overloaded, Unavailable

pytestmark = pytest.mark.integration

MIN_MS, MAX_MS = round(RETRY_AFTER_MIN_S * 1000), round(RETRY_AFTER_MAX_S * 1000)


def test_full_backends_429_reaches_the_client_with_retry_after_ms(daemon, balancer, short_dir):
    d, e = tcp_daemon(daemon, settings={"admission.max_waiting_requests": 0})  # refuses everything: 429
    b = balancer(backends=[e], extra_toml="[retry]\nmax_retries = 1", endpoint=f"ipc://{short_dir}/bal.sock")
    with b.client(timeout=20) as c:
        with pytest.raises(Overloaded) as info:
            c.generate([1, 2], max_tokens=3)
        err = info.value
        assert (err.code, err.reason, err.retryable) == (429, "queue_full", True)
        assert type(err.retry_after_ms) is int and MIN_MS <= err.retry_after_ms <= MAX_MS
        assert c.call("drain", timeout_ms=30_000)["accepting"] is False  # ipc://: an admin connection
        with pytest.raises(Unavailable) as info:
            c.generate([1], max_tokens=1)
        assert info.value.reason == "draining" and MIN_MS <= info.value.retry_after_ms <= 30_000
        c.call("resume")
