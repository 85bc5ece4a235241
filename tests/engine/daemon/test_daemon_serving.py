"""The daemon serving real clients: streaming, cancel, deadlines, back-pressure, drain, SIGTERM, idle cost."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import psutil
import pytest

from idle_activity import idle_activity
from engine.async_client import AsyncClient
from engine.errors import ClientTimeout, DeadlineExceeded, Overloaded, ServerError, Unavailable

pytestmark = pytest.mark.integration

SLOW = {"decode_base_ms": 5.0, "decode_per_lane_ms": 0.0}  # sim backend: a decode step takes 5 ms


def _idle(d, timeout=10.0) -> dict:
    """Stats once no sequence is active any more (the lane is freed)."""
    deadline = time.monotonic() + timeout
    while True:
        st = d.client(timeout=5).stats()
        if st["scheduler"]["active_sequences"] == 0 or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_generate_and_stream_agree_and_report_usage(daemon):
    d = daemon(backend="stub", chips=2)
    with d.client(timeout=20) as c:
        whole = c.generate([1, 2, 3, 4], max_tokens=50, seed=9)
        sink: list = []
        chunks = list(c.stream([1, 2, 3, 4], max_tokens=50, seed=9, result=sink))
    streamed = [t for ch in chunks for t in ch]
    assert streamed == whole.tokens and len(whole.tokens) == 50
    assert whole.finish_reason == "length" and sink[0].finish_reason == "length"
    assert whole.usage["prompt_tokens"] == 4 and whole.usage["completion_tokens"] == 50
    assert whole.timing["ttft_ms"] is not None and whole.timing["e2e_ms"] >= whole.timing["ttft_ms"]


def test_cancel_mid_stream_ends_with_done_cancelled_and_frees_the_lane(daemon):
    d = daemon(backend="sim", chips=1, backend_options=SLOW)
    with d.client(timeout=30) as c:
        sink: list = []
        it = c.stream([1, 2, 3], max_tokens=1000, id="victim", result=sink)
        got = next(it)
        assert got
        c.cancel("victim")
        got += [t for ch in it for t in ch]
        assert sink[0].finish_reason == "cancelled"
        assert len(got) < 1000
        assert sink[0].usage["completion_tokens"] == len(got)
        st = _idle(d)
        assert st["scheduler"]["active_sequences"] == 0
        assert all(ch["kv"]["sequences"]["active"] == 0 for ch in st["scheduler"]["chips"].values())
        assert c.generate([4, 5], max_tokens=3).finish_reason == "length"  # and the chip serves again


def test_closing_a_stream_early_cancels_it_on_the_server(daemon):
    d = daemon(backend="sim", chips=1, backend_options=SLOW)
    with d.client(timeout=30) as c:
        it = c.stream([1, 2, 3], max_tokens=1000)
        next(it)
        it.close()
        st = _idle(d)
    assert st["scheduler"]["active_sequences"] == 0
    assert st["scheduler"]["counters"].get("finished_cancelled", 0) >= 1


def test_deadline_gives_504(daemon):
    d = daemon(backend="sim", chips=1, backend_options=SLOW)
    with d.client(timeout=30) as c:
        with pytest.raises(DeadlineExceeded) as e:
            c.generate([1, 2, 3], max_tokens=1000, deadline_ms=100)
        assert e.value.code == 504
        assert c.generate([1], max_tokens=2).finish_reason == "length"


def test_queue_full_gives_429_and_the_rest_complete(daemon):
    d = daemon(backend="sim", chips=1, backend_options=SLOW,
               settings={"admission.max_sequences": 1, "admission.max_waiting_requests": 1})

    async def run():
        async with AsyncClient(d.endpoint, timeout=60) as c:
            return await asyncio.gather(*(c.generate([1, 2, i], max_tokens=20) for i in range(6)),
                                        return_exceptions=True)

    results = asyncio.run(run())
    rejected = [r for r in results if isinstance(r, Overloaded)]
    done = [r for r in results if not isinstance(r, Exception)]
    assert rejected and all(r.code == 429 and r.retryable for r in rejected)
    assert done and all(r.finish_reason == "length" and len(r.tokens) == 20 for r in done)
    assert len(rejected) + len(done) == 6


def test_drain_gives_503_until_resume(daemon):
    d = daemon(backend="stub", chips=1)
    with d.client(timeout=10) as c:
        assert c.call("drain") == {"accepting": False}
        h = c.health()
        assert h["accepting"] is False and h["ok"] is False
        with pytest.raises(Unavailable) as e:
            c.generate([1, 2], max_tokens=2)
        assert e.value.code == 503 and e.value.retryable
        c.call("resume")
        assert c.generate([1, 2], max_tokens=2).finish_reason == "length"
        assert c.health()["ok"] is True


def test_sigterm_under_load_gives_every_request_its_terminal_event_and_exits_0(daemon):
    # drain budget 0: SIGTERM ends every stream at once (test_daemon_drain_reload covers a real drain)
    d = daemon(backend="sim", chips=2, backend_options=SLOW, settings={"server.drain_timeout_s": 0})
    started = threading.Event()
    outcome: dict[str, list] = {"done": [], "error": [], "timeout": [], "other": []}

    async def one(c: AsyncClient, i: int, first: asyncio.Event, counter: list) -> None:
        try:
            sink: list = []
            seen = False
            async for _ in c.stream([1, 2, i % 250], max_tokens=2000, result=sink):
                if not seen:
                    seen = True
                    counter[0] += 1
                    if counter[0] == 40:
                        first.set()
            outcome["done"].append(sink[0].finish_reason)
        except ClientTimeout:
            outcome["timeout"].append(i)
        except (Unavailable, ServerError) as e:
            outcome["error"].append(e.code)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            outcome["other"].append(repr(e))

    async def run():
        async with AsyncClient(d.endpoint, timeout=30) as c:
            first = asyncio.Event()
            counter = [0]
            tasks = [asyncio.create_task(one(c, i, first, counter)) for i in range(60)]
            await asyncio.wait_for(first.wait(), 30)
            started.set()
            await asyncio.gather(*tasks)

    t = threading.Thread(target=lambda: asyncio.run(run()))
    t.start()
    assert started.wait(40)
    rc = d.stop(signal.SIGTERM)
    t.join(60)
    assert not t.is_alive()
    assert rc == 0
    assert not outcome["timeout"] and not outcome["other"], outcome
    assert len(outcome["done"]) + len(outcome["error"]) == 60
    assert all(code == 503 for code in outcome["error"])
    assert outcome["error"], "the load was still running when SIGTERM arrived"


def test_idle_daemon_sleeps(daemon):
    d = daemon(backend="stub", chips=2)
    with d.client(timeout=10) as c:
        c.generate([1, 2, 3], max_tokens=5)
    time.sleep(2.0)  # let the request's after-work (flushes, the last metrics publish) pass
    procs = [psutil.Process(d.pid)] + psutil.Process(d.pid).children(recursive=True)
    assert len(procs) >= 3
    # Awake only for its timers: each worker's heartbeat (1/s by default) wakes the worker, its zmq
    # I/O thread, the daemon's I/O thread and the daemon's loop; the loop's supervision tick (1/s)
    # adds one. About 8/s in all here (46/s with 200 ms heartbeats and 100 ms supervision); a loop
    # polling with a short timeout would wake hundreds of times, a spinning one burn a core.
    act = idle_activity(procs, window_s=3.0, tries=5, max_wakeups_per_s=30, max_cpu_share=0.10)
    assert act.wakeups_per_s <= 30, f"idle daemon + workers woke too often: {act}"
    assert act.cpu_share <= 0.10, f"idle daemon + workers spun between wake-ups: {act}"


def test_a_vanished_client_has_its_streams_cancelled(daemon):
    import orjson
    import zmq

    d = daemon(backend="sim", chips=1, backend_options=SLOW)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(d.endpoint)
    for i in range(3):
        s.send(orjson.dumps({"v": 1, "op": "generate", "id": f"v{i}", "prompt": [1, i], "max_tokens": 1000}))
    assert s.poll(10_000)
    s.recv()
    s.close(0)
    ctx.term()
    st = _idle(d)
    assert st["scheduler"]["active_sequences"] == 0
    assert st["daemon"]["cancelled_dead_clients"] == 3
    assert st["frontend"]["dropped_clients"] == 1


def test_sigint_stops_cleanly_too(daemon):
    d = daemon(backend="stub", chips=1)
    with d.client(timeout=10) as c:
        assert c.generate([1], max_tokens=2).finish_reason == "length"
    assert d.stop(signal.SIGINT) == 0
    assert not os.path.exists(d.endpoint[len("ipc://"):])


def test_continuation_resumes_exactly_where_the_first_stream_broke(daemon):
    d = daemon(backend="stub", chips=2)
    with d.client(timeout=20) as c:
        whole = c.generate([9, 8, 7], max_tokens=12, seed=3)
        resumed = c.generate([9, 8, 7], max_tokens=12, seed=3, continuation=whole.tokens[:5])
    assert resumed.tokens == whole.tokens[5:]
    assert resumed.usage["completion_tokens"] == 7 and resumed.finish_reason == "length"


def test_port_in_use_fails_start_up_with_a_message(daemon):
    import socket

    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        so.listen()
        port = so.getsockname()[1]
        d = daemon(backend="stub", chips=1, extra=["--endpoint", f"tcp://127.0.0.1:{port}"], wait=False)
        assert d.proc.wait(60) == 1
    d.expect_exit = 1
    assert "cannot listen" in d.log()
