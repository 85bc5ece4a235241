"""When a refused request may come back: the `retry_after_ms` of every retryable 429/503.

A refusal that says "retry" should also say when, so a client (or a balancer,
or an HTTP client reading `Retry-After`) neither hammers a full board nor
waits for nothing. The estimates come from what the refusing process knows:

* a full queue (429 queue_full / queue_tokens_full / tenant_quota): how fast
  the waiting queue is drained, measured here (`QueueDrainRate`, fed `now` by
  the scheduler) against how much must leave before the request fits;
* a queue that serves too late (429 queue_wait_exceeded): how long until the
  queue ahead is short enough to be served within admission.max_queue_wait_ms;
* a drain (503 draining): the time left until the drain deadline;
* a model or process that is not there (503 model_unavailable, recovering,
  shutdown, no backend): `NOT_READY_RETRY_S`, about one supervised restart.

Every estimate is clamped to [RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S]: never
"now" (a retry storm), never so long that a client gives up on a board that
recovers in seconds.
"""

from __future__ import annotations

import math
from collections import deque

RETRY_AFTER_MIN_S = 0.1
RETRY_AFTER_MAX_S = 60.0
# A model not ready (loading, recovering, unloading) or a process shutting down: about one supervised
# restart (RestartSec=2 in engine/deploy/npuserve@.service), after which a retry may find it serving.
NOT_READY_RETRY_S = 2.0
DRAIN_RATE_WINDOW_S = 10.0  # how far back the queue's drain rate looks
_BUCKET_S = 0.5  # departures are counted per bucket: constant memory whatever the rate


def clamp_ms(seconds: float) -> int:
    """An estimate in seconds as the wire's `retry_after_ms`: clamped, whole milliseconds rounded up."""
    if not seconds == seconds:  # NaN: no estimate at all, the longest wait is the safe answer
        seconds = RETRY_AFTER_MAX_S
    return math.ceil(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, seconds)) * 1000)


def header_seconds(retry_after_ms: int) -> int:
    """HTTP `Retry-After` (whole seconds): rounded up, so a client never comes back before the estimate."""
    return max(0, math.ceil(retry_after_ms / 1000))


def until_ms(now: float, at: float | None) -> int:
    """Time left until `at` (a drain deadline); the longest wait when there is none or it has passed
    (admission stays closed until an operator reopens it: no end in sight)."""
    if at is None or at <= now:
        return clamp_ms(RETRY_AFTER_MAX_S)
    return clamp_ms(at - now)


class QueueDrainRate:
    """Requests (and their prompt tokens) leaving a waiting queue for service over the last `window_s`.

    Fed with `now` by its owner, so it reads no clock. With nothing admitted in
    the whole window the rate is taken as one request (and its tokens) per
    window: slower than anything measurable, so the estimate errs long.
    """

    def __init__(self, window_s: float = DRAIN_RATE_WINDOW_S) -> None:
        assert window_s >= 2 * _BUCKET_S
        self.window_s = window_s
        self._buckets: deque[list] = deque()  # [bucket index, requests, tokens], oldest first
        self._requests = 0
        self._tokens = 0

    def record(self, now: float, tokens: int) -> None:
        """One request of `tokens` prompt tokens left the queue (was admitted) at `now`."""
        idx = math.floor(now / _BUCKET_S)
        if self._buckets and self._buckets[-1][0] == idx:
            b = self._buckets[-1]
            b[1] += 1
            b[2] += tokens
        else:
            self._buckets.append([idx, 1, tokens])
        self._requests += 1
        self._tokens += tokens
        self._trim(now)

    def _trim(self, now: float) -> float:
        """Forget the buckets that start before the window; returns the span the kept ones cover (to `now`)."""
        first = math.ceil((now - self.window_s) / _BUCKET_S)
        while self._buckets and self._buckets[0][0] < first:
            _, n, t = self._buckets.popleft()
            self._requests -= n
            self._tokens -= t
        return now - first * _BUCKET_S  # in (window - bucket, window]

    def rates(self, now: float) -> tuple[float, float]:
        """(requests per second, prompt tokens per second) over the window; (0, 0) when nothing left."""
        span = self._trim(now)
        return self._requests / span, self._tokens / span

    def seconds_until(self, now: float, requests: int = 0, tokens: int = 0) -> float:
        """How long until `requests` more requests and `tokens` more prompt tokens have left the queue."""
        r_rate, t_rate = self.rates(now)
        wait = 0.0
        if requests > 0:
            wait = max(wait, requests / r_rate if r_rate > 0 else requests * self.window_s)
        if tokens > 0:
            wait = max(wait, tokens / t_rate if t_rate > 0 else self.window_s)
        return wait
