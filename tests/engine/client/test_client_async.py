"""The AsyncClient against a scripted fake server (no daemon)."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import errors
from engine.async_client import AsyncClient
from conftest import CODES, done_ev, echo_server as _echo, error_ev, tokens_ev


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("code,cls", CODES)
def test_server_error_codes_become_their_exception(fake_server, code, cls):
    srv = fake_server(lambda m: [error_ev(m["id"], code, "why", retryable=code == 503)])

    async def go():
        async with AsyncClient(srv.endpoint, timeout=5) as c:
            await c.generate([1])

    with pytest.raises(cls) as e:
        run(go())
    assert e.value.code == code and e.value.retryable == (code == 503)


def test_many_concurrent_requests_on_one_socket(fake_server):
    srv = fake_server(_echo)

    async def go():
        async with AsyncClient(srv.endpoint, timeout=10) as c:
            async def streamed(i):
                return [t for ch in [x async for x in c.stream([i, i + 1])] for t in ch]
            gens = [c.generate([i, 7]) for i in range(150)]
            streams = [streamed(i) for i in range(150)]
            return await asyncio.gather(*gens), await asyncio.gather(*streams), await c.health()

    gens, streams, health = run(go())
    assert [r.tokens for r in gens] == [[i + 1, 8] for i in range(150)]
    assert streams == [[i + 1, i + 2] for i in range(150)]
    assert health == {"ok": True}


async def until_cancelled(srv, timeout: float = 10.0) -> None:
    """Keep the client open until the server has seen a cancel (polled, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while not srv.cancels():
        assert time.monotonic() < deadline, "no cancel reached the server"
        await asyncio.sleep(0.01)


def test_timeout_raises_and_cancels(fake_server):
    srv = fake_server(lambda m: [])

    async def go():
        async with AsyncClient(srv.endpoint) as c:
            t0 = time.monotonic()
            with pytest.raises(errors.ClientTimeout):
                await c.generate([1], id="late", timeout=0.2)
            assert time.monotonic() - t0 < 10  # 0.2 s asked; generous for a loaded machine
            await until_cancelled(srv)

    run(go())
    assert srv.cancels() == ["late"]


def test_breaking_out_of_a_stream_cancels_it(fake_server):
    srv = fake_server(lambda m: [tokens_ev(m["id"], [1]), tokens_ev(m["id"], [2])] if m["op"] == "generate" else [])

    async def go():
        async with AsyncClient(srv.endpoint, timeout=5) as c:
            agen = c.stream([1], id="brk")
            async for chunk in agen:
                assert chunk == [1]
                break
            await agen.aclose()
            await until_cancelled(srv)

    run(go())
    assert srv.cancels() == ["brk"]


def test_stream_result_sink_and_done_tokens(fake_server):
    srv = fake_server(lambda m: [tokens_ev(m["id"], [4, 5]), done_ev(m["id"], reason="eos")])

    async def go():
        async with AsyncClient(srv.endpoint, timeout=5) as c:
            sink: list = []
            chunks = [ch async for ch in c.stream([1], result=sink)]
            return chunks, sink[0]

    chunks, res = run(go())
    assert chunks == [[4, 5]] and res.tokens == [4, 5] and res.finish_reason == "eos"
