"""admission.max_queue_wait_ms on a real daemon: a burst beyond capacity gets 429 queue_wait_exceeded over the
wire, retryable and soon after the bound (not after waiting its turn), the rest finish, the daemon keeps serving."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_client import AsyncClient
from engine.errors import Overloaded

pytestmark = pytest.mark.integration

SLOW = {"decode_base_ms": 5.0, "decode_per_lane_ms": 0.0}  # sim backend: a decode step takes 5 ms
BURST, MAX_TOKENS, BOUND_MS = 8, 60, 300  # served one at a time, the burst would take >= 8 * 60 * 5 ms = 2.4 s


def test_a_burst_past_the_wait_bound_gets_429_queue_wait_exceeded_and_the_rest_finish(daemon):
    d = daemon(backend="sim", chips=1, backend_options=SLOW,
               settings={"admission.max_sequences": 1, "admission.max_queue_wait_ms": BOUND_MS})

    async def one(c: AsyncClient, i: int):
        t0 = time.monotonic()
        try:
            r = await c.generate([1, 2, 3 + i], max_tokens=MAX_TOKENS)
        except Exception as e:  # noqa: BLE001 - sorted below
            r = e
        return r, time.monotonic() - t0

    async def run():
        async with AsyncClient(d.endpoint, timeout=60) as c:
            return await asyncio.gather(*(one(c, i) for i in range(BURST)))

    results = asyncio.run(run())
    shed = [(r, dt) for r, dt in results if isinstance(r, Overloaded)]
    done = [r for r, _ in results if not isinstance(r, Exception)]
    assert len(shed) + len(done) == BURST, [r for r, _ in results]
    assert shed and done
    for e, dt in shed:
        assert (e.code, e.reason, e.retryable) == (429, "queue_wait_exceeded", True), e
        assert "max_queue_wait_ms" in e.message
        assert dt < 1.5, dt  # pushed back at about the bound, not answered when its turn would have come
    assert all(r.finish_reason == "length" and len(r.tokens) == MAX_TOKENS for r in done)
    with d.client(timeout=20) as c:
        assert c.generate([4, 5], max_tokens=3).finish_reason == "length"  # and it keeps serving
        counters = c.stats()["scheduler"]["counters"]
    assert counters.get("failed_queue_wait_exceeded", 0) + counters.get("rejected_queue_wait_exceeded", 0) \
        == len(shed)
