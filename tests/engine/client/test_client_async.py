"""The AsyncClient against a scripted fake server (no daemon)."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import errors
from engine.async_client import AsyncClient, Inbox, _Expired, dispatch
from fake_server import CODES, done_ev, echo_server as _echo, error_ev, tokens_ev


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
            # the server never answers: only the client's own 0.2 s timeout can end this call (the hang guard
            # around it is far longer and raises another error)
            with pytest.raises(errors.ClientTimeout):
                await asyncio.wait_for(c.generate([1], id="late", timeout=0.2), 60)
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


class Recorder:
    """A queue stand-in that logs, in one list shared by all, which request got which event in what order."""

    def __init__(self, log: list, rid: str) -> None:
        self.log, self.rid = log, rid

    def put_nowait(self, ev: dict) -> None:
        self.log.append((self.rid, ev["n"]))


def test_dispatch_puts_first_events_first_and_keeps_each_requests_order():
    log: list = []
    queues = {rid: Recorder(log, rid) for rid in ("old1", "old2", "new1", "new2")}
    unanswered = {"new1", "new2"}
    burst = [{"id": "old1", "n": 1}, {"id": "new1", "n": 1}, {"id": "old2", "n": 1}, {"id": "new1", "n": 2},
             None, {"id": "gone", "n": 1}, {"id": "old1", "n": 2}, {"id": "new2", "n": 1}]
    dispatch(burst, queues, unanswered)
    assert log == [("new1", 1), ("new2", 1), ("old1", 1), ("old2", 1), ("new1", 2), ("old1", 2)]
    assert unanswered == set()
    log.clear()
    dispatch([{"id": "old2", "n": 3}, {"id": "new1", "n": 3}], queues, unanswered)
    assert log == [("old2", 3), ("new1", 3)]  # answered once: no priority any more


def test_a_new_streams_first_tokens_wake_its_task_before_the_running_streams():
    """One burst carries the running streams' next tokens and, last, a new stream's first: its reader runs first
    (each inbox's waiter is woken in the order of the puts)."""

    async def go():
        order = []
        queues = {rid: Inbox() for rid in ("run0", "run1", "run2", "new")}

        async def reader(rid):
            await queues[rid].get()
            order.append(rid)

        readers = [asyncio.ensure_future(reader(rid)) for rid in queues]
        await asyncio.sleep(0)  # all four wait on their queues
        dispatch([tokens_ev(f"run{i}", [9]) for i in range(3)] + [tokens_ev("new", [1])], queues, {"new"})
        await asyncio.gather(*readers)
        return order

    assert run(go()) == ["new", "run0", "run1", "run2"]


def test_finished_and_timed_out_requests_leave_no_bookkeeping(fake_server):
    srv = fake_server(lambda m: [tokens_ev(m["id"], [4]), done_ev(m["id"])] if m["id"] != "mute" else [])

    async def go():
        async with AsyncClient(srv.endpoint, timeout=5) as c:
            await c.generate([1])
            [ch async for ch in c.stream([1])]
            with pytest.raises(errors.ClientTimeout):
                await c.generate([1], id="mute", timeout=0.05)
            return dict(c._queues), set(c._unanswered)

    assert run(go()) == ({}, set())


def test_inbox_hands_out_what_arrived_before_failing_an_empty_wait_past_its_deadline():
    async def go():
        loop = asyncio.get_running_loop()
        q = Inbox()
        q.expire_at(loop.time() + 0.05)
        waiter = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        q.put_nowait({"n": 1})  # wakes the waiting reader
        assert (await waiter) == {"n": 1}
        q.put_nowait({"n": 2})
        q.put_nowait({"n": 3})
        await asyncio.sleep(0.1)  # past the deadline: what arrived is still handed out, in order
        got = [await q.get(), await q.get()]
        empty = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)  # one loop turn, no timer: empty and expired, it fails at once
        assert empty.done()
        with pytest.raises(_Expired):
            empty.result()
        late = Inbox()
        late.expire_at(loop.time() + 0.05)
        with pytest.raises(_Expired):
            await asyncio.wait_for(late.get(), 10)  # a wait in progress is woken by the deadline
        kept = Inbox()
        kept.expire_at(loop.time() + 0.05)
        kept.close()  # the request ended: its timer is gone
        waiting = asyncio.ensure_future(kept.get())
        await asyncio.sleep(0.15)
        assert not waiting.done()
        waiting.cancel()
        return got

    assert run(go()) == [{"n": 2}, {"n": 3}]


def test_events_that_arrived_before_the_deadline_are_streamed_after_it(fake_server):
    srv = fake_server(lambda m: [tokens_ev(m["id"], [4]), tokens_ev(m["id"], [5])] if m["op"] == "generate" else [])

    async def go():
        async with AsyncClient(srv.endpoint) as c:
            agen = c.stream([1], id="slow", timeout=0.3)
            got = [await agen.__anext__()]
            await asyncio.sleep(0.6)  # the consumer is slow; the second event is already in the inbox
            got.append(await agen.__anext__())
            with pytest.raises(errors.ClientTimeout):
                await agen.__anext__()  # nothing more came: the deadline applies to the wait
            await agen.aclose()
            await until_cancelled(srv)
            return got

    assert run(go()) == [[4], [5]]

