"""The balancer's retry_after_ms with a fake clock: a backend's estimate is kept when its error is forwarded (and
after the retries run out on it); the balancer's own refusals (draining, no backend, shutdown) carry its own
estimate; a non-retryable error carries none."""

from __future__ import annotations

from engine.balancer.actions import FailRequest
from engine.balancer.backend_state import Health
from engine.core.retry_after import NOT_READY_RETRY_S, RETRY_AFTER_MAX_S, clamp_ms
from test_balancer_core import A, B, error, gen, make, sends


def with_hint(ev: dict, ms: int) -> dict:
    return {**ev, "retry_after_ms": ms}


def test_retries_exhausted_on_full_backends_keep_the_last_backends_estimate():
    core = make(max_retries=1, backoff_base_s=0.1)
    (s,) = sends(core.submit(1, gen(), 0.1))
    assert core.on_event(s.backend, with_hint(error(s.msg["id"], 429, "queue_full"), 7000), 0.1) == []
    (s2,) = sends(core.tick(0.3))
    (f,) = core.on_event(s2.backend, with_hint(error(s2.msg["id"], 429, "queue_full"), 2500), 0.3)
    assert isinstance(f, FailRequest) and (f.code, f.reason, f.retryable) == (429, "queue_full", True)
    assert f.retry_after_ms == 2500


def test_a_forwarded_error_keeps_the_backends_estimate_and_a_non_retryable_one_has_none():
    core = make(migrate=False)
    (s,) = sends(core.submit(1, gen(), 0.1))
    core.on_event(s.backend, {"v": 1, "ev": "tokens", "id": s.msg["id"], "tokens": [4]}, 0.1)
    # streamed already: a 429 cannot be retried, it is passed on as the backend said it
    (f,) = core.on_event(s.backend, with_hint(error(s.msg["id"], 429, "queue_wait_exceeded"), 1234), 0.2)
    assert (f.code, f.reason, f.retry_after_ms) == (429, "queue_wait_exceeded", 1234)
    (s,) = sends(core.submit(2, gen(), 0.3))
    (f,) = core.on_event(s.backend, error(s.msg["id"], 400, "context_too_long", False), 0.3)
    assert (f.code, f.retryable, f.retry_after_ms) == (400, False, None)


def test_draining_says_the_time_left_of_the_balancers_drain():
    core = make()
    core.drain(1.0, timeout_s=4.0)
    (f,) = core.submit(1, gen(), 2.0)
    assert (f.code, f.reason, f.retry_after_ms) == (503, "draining", 3000)
    core.resume()
    core.drain(10.0, timeout_s=None)  # no end known
    (f,) = core.submit(2, gen(), 10.0)
    assert f.retry_after_ms == clamp_ms(RETRY_AFTER_MAX_S)


def test_no_backend_says_when_the_soonest_backend_may_be_back():
    core = make(names=(A, B), no_backend_wait_s=0.3)
    pol = core.config.health
    # both out: A's breaker opened at 1.0, B's at 1.5 (cooldown 1 s each), then a heartbeat each
    core.backends[A].open("test", 1.0, pol)
    core.backends[B].open("test", 1.5, pol)
    assert core.submit(1, gen(), 1.6) == []  # waits for a routable backend
    out = []
    now = 1.6
    while not out:
        now += 0.05
        out = [a for a in core.tick(now) if isinstance(a, FailRequest)]
    (f,) = out
    assert (f.code, f.retryable) == (503, True)
    assert now < 2.0 and (pol.cooldown_s, pol.heartbeat_interval_s) == (1.0, 1.0)
    # A (the sooner): its cooldown ends at 2.0, then one heartbeat interval
    assert f.retry_after_ms == clamp_ms(2.0 - now + 1.0)
    assert core.backends[A].health is Health.OUT


def test_every_backend_drained_by_an_admin_gives_the_longest_wait():
    core = make(names=(A, B), no_backend_wait_s=0.2)
    core.set_drained(A, True)
    core.set_drained(B, True)
    assert core.submit(1, gen(), 1.0) == []
    out = []
    now = 1.0
    while not out:
        now += 0.05
        out = [a for a in core.tick(now) if isinstance(a, FailRequest)]
    assert out[0].retry_after_ms == clamp_ms(RETRY_AFTER_MAX_S)


def test_shutdown_carries_the_restart_estimate():
    core = make()
    (s,) = sends(core.submit(1, gen(), 0.1))
    out = core.shutdown(0.2)
    (f,) = [a for a in out if isinstance(a, FailRequest)]
    assert (f.code, f.reason, f.retry_after_ms) == (503, "shutdown", clamp_ms(NOT_READY_RETRY_S))
