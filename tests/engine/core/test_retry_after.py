"""retry_after_ms with a fake clock: the queue's drain-rate estimator, the clamp, and what the scheduler puts on
each retryable refusal (queue full, queue tokens full, queue wait exceeded, draining, shutdown) and not on the
others."""

from __future__ import annotations

import math

import pytest

from engine.core.actions import FailRequest
from engine.core.retry_after import (DRAIN_RATE_WINDOW_S, NOT_READY_RETRY_S, RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S,
                                     QueueDrainRate, clamp_ms, header_seconds, until_ms)
from engine.core.scheduler_config import SchedulerConfig
from test_scheduler_fakes import FakeExecutor, make_scheduler, params

MIN_MS, MAX_MS = round(RETRY_AFTER_MIN_S * 1000), round(RETRY_AFTER_MAX_S * 1000)


# ---------------------------------------------------------------- the estimator


def test_rate_counts_the_departures_of_the_window_only():
    q = QueueDrainRate(window_s=10.0)
    for i in range(20):  # 20 requests of 100 tokens over the first 2 s: 2 per second over the window
        q.record(i * 0.1, 100)
    assert q.rates(2.0) == pytest.approx((2.0, 200.0))
    assert q.seconds_until(2.0, requests=4) == pytest.approx(2.0)  # 4 more at 2/s
    assert q.seconds_until(2.0, tokens=1000) == pytest.approx(5.0)  # 1000 tokens at 200/s
    assert q.seconds_until(2.0, requests=1, tokens=1000) == pytest.approx(5.0)  # both must leave: the longer
    assert q.rates(30.0) == (0.0, 0.0)  # all of them older than the window: forgotten


def test_a_faster_drain_gives_a_shorter_wait():
    slow, fast = QueueDrainRate(), QueueDrainRate()
    for i in range(30):
        if i % 3 == 0:
            slow.record(1.0 + i / 3, 10)  # 1 per second
        fast.record(1.0 + i / 3, 10)  # 3 per second
    assert fast.seconds_until(10.5, requests=3) == pytest.approx(1.0)
    assert slow.seconds_until(10.5, requests=3) == pytest.approx(3.0)


def test_nothing_admitted_in_the_window_counts_as_one_per_window():
    q = QueueDrainRate(window_s=5.0)
    assert q.seconds_until(0.0, requests=1) == 5.0
    assert q.seconds_until(0.0, requests=3) == 15.0
    assert q.seconds_until(0.0, tokens=50) == 5.0
    assert q.seconds_until(0.0) == 0.0  # nothing has to leave


def test_memory_stays_bounded_whatever_the_rate():
    q = QueueDrainRate(window_s=2.0)
    for i in range(100_000):
        q.record(i * 0.001, 1)  # 1000 per second for 100 s
    assert len(q._buckets) <= 2.0 / 0.5 + 1
    assert q.rates(99.999)[0] == pytest.approx(1000.0, rel=0.01)


def test_clamp_keeps_estimates_in_range_and_rounds_up():
    assert clamp_ms(0.0) == MIN_MS
    assert clamp_ms(-3.0) == MIN_MS
    assert clamp_ms(1e9) == MAX_MS
    assert clamp_ms(math.inf) == MAX_MS
    assert clamp_ms(math.nan) == MAX_MS
    assert clamp_ms(1.2341) == 1235
    assert header_seconds(1) == 1 and header_seconds(1000) == 1 and header_seconds(1001) == 2
    assert header_seconds(0) == 0


def test_until_is_the_time_left_and_the_longest_wait_once_past_or_unknown():
    assert until_ms(10.0, 12.5) == 2500
    assert until_ms(10.0, 10.05) == MIN_MS
    assert until_ms(10.0, 9.0) == MAX_MS
    assert until_ms(10.0, None) == MAX_MS


# ---------------------------------------------------------------- the scheduler's refusals


def drain_at(rate_per_s: float, seconds: float, s, now: float) -> None:
    """Feed the scheduler's estimator admissions at `rate_per_s` for the `seconds` before `now`."""
    n = round(rate_per_s * seconds)
    for i in range(n):
        s.drain_rate.record(now - seconds + i / rate_per_s, 8)


def test_queue_full_says_how_long_until_the_queue_has_room():
    s = make_scheduler(SchedulerConfig(max_sequences=1, max_waiting_requests=2))
    ex = FakeExecutor(s)
    ex.submit(1, params(seed=1, max_tokens=50))
    ex.handle(s.tick(0.0))  # admitted: holds the only lane; what comes next waits
    ex.submit(2, params(seed=2), 0.0)
    ex.submit(3, params(seed=3), 0.0)
    (r,) = s.submit(4, params(seed=4), 0.0)
    assert (r.code, r.reason) == (429, "queue_full")
    # one admission in the window (request 1): one per 10 s, one must leave -> 10 s
    assert r.retry_after_ms == clamp_ms(DRAIN_RATE_WINDOW_S / 1)
    drain_at(4.0, DRAIN_RATE_WINDOW_S, s, 20.0)  # 4 admissions per second lately
    (r,) = s.submit(5, params(seed=5), 20.0)
    assert r.reason == "queue_full" and r.retry_after_ms == 250  # one must leave at 4/s


def test_queue_tokens_full_counts_the_tokens_that_must_leave():
    s = make_scheduler(SchedulerConfig(max_sequences=1, max_waiting_prompt_tokens=100))
    ex = FakeExecutor(s)
    ex.submit(1, params(n_prompt=8, seed=1, max_tokens=50))
    ex.handle(s.tick(0.0))
    ex.submit(2, params(n_prompt=90, seed=2), 0.0)
    s.drain_rate = type(s.drain_rate)(window_s=10.0)
    for i in range(10):  # 100 tokens per second
        s.drain_rate.record(0.5 + i * 1.0, 100)
    (r,) = s.submit(3, params(n_prompt=60, seed=3), 10.0)
    assert (r.code, r.reason) == (429, "queue_tokens_full")
    assert r.retry_after_ms == 500  # 90 + 60 - 100 = 50 tokens at 100/s


def test_queue_wait_exceeded_says_when_the_queue_is_short_enough():
    s = make_scheduler(SchedulerConfig(max_sequences=1, max_queue_wait_s=1.0))
    ex = FakeExecutor(s)
    for i in range(19):  # admissions every 0.5 s over the 9 s before the test starts
        s.drain_rate.record(-9.0 + 0.5 * i, 8)
    ex.submit(1, params(seed=1, max_tokens=500))
    ex.handle(s.tick(0.0))  # admitted (the 20th): holds the only lane
    for rid in range(2, 12):  # ten wait behind it
        ex.submit(rid, params(seed=rid), 0.0)
    ex.handle(s.tick(1.0))  # every wait ran out at once
    fails = [a for a in ex.terminal.values() if isinstance(a, FailRequest)]
    assert len(fails) == 10 and {f.reason for f in fails} == {"queue_wait_exceeded"}
    # 20 admissions in the 10 s window: 2/s; ten ahead take 5 s, minus the 1 s a request
    # may wait: 4 s
    assert {f.retry_after_ms for f in fails} == {4000}


def test_draining_says_the_time_left_and_shutdown_the_restart_estimate():
    s = make_scheduler()
    s.set_accepting(False, "draining", reopen_at=30.0)
    (r,) = s.submit(1, params(), 12.5)
    assert (r.code, r.reason, r.retryable, r.retry_after_ms) == (503, "draining", True, 17500)
    (r,) = s.submit(2, params(), 31.0)  # past the deadline, still closed: no end in sight
    assert r.retry_after_ms == MAX_MS
    s.set_accepting(True)
    ex = FakeExecutor(s)
    ex.submit(3, params(max_tokens=50), 31.0)
    ex.handle(s.tick(31.0))
    (r,) = s.shutdown(32.0)
    assert (r.code, r.reason, r.retry_after_ms) == (503, "shutdown", clamp_ms(NOT_READY_RETRY_S))
    s.set_accepting(True)
    s.set_accepting(False, "draining")  # closed with no deadline known
    (r,) = s.submit(4, params(), 33.0)
    assert r.retry_after_ms == MAX_MS


def test_non_retryable_refusals_carry_no_retry_after():
    s = make_scheduler(max_seq=64)
    (r,) = s.submit(1, params(n_prompt=60, max_tokens=10), 0.0)  # context too long: 400
    assert (r.code, r.retryable, r.retry_after_ms) == (400, False, None)
    ex = FakeExecutor(s)
    ex.submit(2, params(max_tokens=50, deadline_ms=100), 0.0)
    ex.handle(s.tick(0.0))
    ex.handle(s.tick(1.0))
    f = ex.terminal[2]
    assert (f.code, f.retry_after_ms) == (504, None)
