"""admission.max_queue_wait_ms on a real daemon: a burst beyond capacity gets 429 queue_wait_exceeded over the
wire, retryable and while the capacity is still taken (at the bound, not when its turn comes), later requests
finish, the daemon keeps serving."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_client import AsyncClient
from engine.errors import Overloaded

pytestmark = pytest.mark.integration

SLOW = {"decode_base_ms": 5.0, "decode_per_lane_ms": 0.0, "max_seq": 65536}  # sim: a step is 5 ms
BURST, MAX_TOKENS, BOUND_MS = 8, 60, 300
HOLD_TOKENS = 64_000  # 5 minutes of decoding, past the hang guard: the holder runs until the test cancels it


def test_a_burst_past_the_wait_bound_gets_429_queue_wait_exceeded_and_the_rest_finish(daemon):
    """One sequence, held by a stream that never ends on its own: the burst behind it can only be answered by
    the wait bound, so each 429 arriving while the holder still streams is the bound's doing, not its turn
    coming (a bound checked only when a sequence frees would leave the burst waiting until the holder is
    cancelled, and the test would see the holder finish first)."""
    d = daemon(backend="sim", chips=1, backend_options=SLOW,
               settings={"admission.max_sequences": 1, "admission.max_queue_wait_ms": BOUND_MS})

    async def one(c: AsyncClient, i: int):
        try:
            return await c.generate([1, 2, 3 + i], max_tokens=MAX_TOKENS)
        except Exception as e:  # noqa: BLE001 - sorted below
            return e

    async def run():
        async with AsyncClient(d.endpoint, timeout=120) as c:
            holder = c.stream([7, 7, 7], max_tokens=HOLD_TOKENS)
            held = [len(await holder.__anext__())]  # decoding: it holds the only sequence
            ended = asyncio.Event()

            async def drain():
                async for chunk in holder:
                    held.append(len(chunk))
                ended.set()

            drainer = asyncio.ensure_future(drain())
            burst = await asyncio.gather(*(one(c, i) for i in range(BURST)))
            still_holding = not ended.is_set() and not drainer.done()
            drainer.cancel()
            try:
                await drainer
            except asyncio.CancelledError:
                pass
            await holder.aclose()  # cancels the holder on the server
            after = [await one(c, BURST + k) for k in range(2)]  # one after another: each admitted at once
            return burst, still_holding, after

    burst, still_holding, after = asyncio.run(asyncio.wait_for(run(), 120))  # a hang guard only
    shed = [r for r in burst if isinstance(r, Overloaded)]
    assert len(shed) == BURST, burst  # nothing behind the holder could be admitted
    assert still_holding, "the 429s came only once the sequence was free: the bound did not answer them"
    for e in shed:
        assert (e.code, e.reason, e.retryable) == (429, "queue_wait_exceeded", True), e
        assert "max_queue_wait_ms" in e.message
    assert all(not isinstance(r, Exception) and r.finish_reason == "length" and len(r.tokens) == MAX_TOKENS
               for r in after), after
    with d.client(timeout=20) as c:
        assert c.generate([4, 5], max_tokens=3).finish_reason == "length"  # and it keeps serving
        counters = c.stats()["scheduler"]["counters"]
    assert counters.get("failed_queue_wait_exceeded", 0) + counters.get("rejected_queue_wait_exceeded", 0) \
        == len(shed)
