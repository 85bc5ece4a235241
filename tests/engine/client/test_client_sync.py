"""The synchronous Client against a scripted fake server (no daemon)."""

from __future__ import annotations

import threading

import pytest

from engine import errors
from engine.client import Client
from fake_server import CODES, done_ev, echo_server as _echo, error_ev, tokens_ev
from waiting import wait_until

@pytest.mark.parametrize("code,cls", CODES)
def test_server_error_codes_become_their_exception(fake_server, code, cls):
    srv = fake_server(lambda m: [error_ev(m["id"], code, "why", retryable=code == 429)])
    with Client(srv.endpoint, timeout=5) as c:
        with pytest.raises(cls) as e:
            c.generate([1])
    assert isinstance(e.value, errors.ClientError)
    assert e.value.code == code and e.value.reason == "why" and e.value.retryable == (code == 429)


def test_generate_stream_health_stats(fake_server):
    srv = fake_server(_echo)
    with Client(srv.endpoint, timeout=5) as c:
        r = c.generate([1, 2, 3], max_tokens=3, seed=4)
        assert r.tokens == [2, 3, 4] and r.finish_reason == "length" and r.usage["completion_tokens"] == 3
        sink: list = []
        assert list(c.stream([5, 6, 7], result=sink)) == [[6], [7, 8]]
        assert sink[0].tokens == [6, 7, 8]
        assert c.health() == {"ok": True} and c.stats() == {"ok": True}
    gen = [m for m in srv.received if m["op"] == "generate"]
    assert gen[0]["stream"] is False and gen[0]["seed"] == 4 and gen[0]["v"] == 1
    assert gen[1]["stream"] is True


def test_unknown_sampling_argument_is_a_type_error(fake_server):
    srv = fake_server(_echo)
    with Client(srv.endpoint, timeout=5) as c:
        with pytest.raises(TypeError, match="max_token"):
            c.generate([1], max_token=3)


def test_timeout_raises_and_cancels_on_the_server(fake_server):
    srv = fake_server(lambda m: [])  # never answers
    with Client(srv.endpoint) as c:
        with pytest.raises(errors.ClientTimeout):  # the server never answers: only the 0.2 s can end it
            c.generate([1], timeout=0.2, id="slow")
        wait_until(lambda: "slow" in srv.cancels(), what="the cancel reaching the server")
    assert srv.cancels() == ["slow"]


def test_leaving_a_stream_early_cancels_it(fake_server):
    srv = fake_server(lambda m: [tokens_ev(m["id"], [1])] if m["op"] == "generate" else [])
    with Client(srv.endpoint, timeout=5) as c:
        it = c.stream([1], id="s1")
        assert next(it) == [1]
        it.close()
        wait_until(lambda: srv.cancels(), what="the cancel reaching the server")
    assert srv.cancels() == ["s1"]


def test_many_threads_share_one_client(fake_server):
    srv = fake_server(_echo)
    failures: list = []
    with Client(srv.endpoint, timeout=10) as c:
        def worker(k: int) -> None:
            try:
                for i in range(25):
                    prompt = [k, i, 100 + k]
                    if i % 2:
                        assert c.generate(prompt).tokens == [k + 1, i + 1, 101 + k]
                    else:
                        assert [t for ch in c.stream(prompt) for t in ch] == [k + 1, i + 1, 101 + k]
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert not failures, failures[:3]
    assert len([m for m in srv.received if m["op"] == "generate"]) == 200


def test_interleaved_streams_in_one_thread_are_demultiplexed(fake_server):
    pending: dict = {}

    def hold_then_flush(m):
        # Answer nothing until both requests arrived, then answer them interleaved, second first.
        pending[m["id"]] = m
        if len(pending) < 2:
            return []
        a, b = list(pending)
        return [tokens_ev(b, [20]), tokens_ev(a, [10]), tokens_ev(b, [21]), done_ev(b), tokens_ev(a, [11]),
                done_ev(a)]

    srv = fake_server(hold_then_flush)
    with Client(srv.endpoint, timeout=5) as c:
        s1 = c.stream([1], id="a")
        s2 = c.stream([2], id="b")
        # stream() sends at once; both requests are in flight before either is read.
        first_a = next(s1)
        assert first_a == [10]
        assert list(s2) == [[20], [21]]
        assert list(s1) == [[11]]


def test_duplicate_id_on_one_client_is_refused_locally(fake_server):
    srv = fake_server(lambda m: [])
    with Client(srv.endpoint, timeout=5) as c:
        c._start("x", {"v": 1, "op": "health", "id": "x"})
        with pytest.raises(errors.InvalidRequest):
            c.generate([1], id="x")


def test_the_connection_opens_with_hello_and_a_server_without_it_still_serves(fake_server):
    srv = fake_server(lambda m: [tokens_ev(m["id"], [5]), done_ev(m["id"])] if m["op"] == "generate" else [])
    with Client(srv.endpoint, timeout=5) as c:
        assert c.generate([1]).tokens == [5]  # the 400 unknown_op answering hello names no request of ours
    assert [h["capabilities"] for h in srv.hellos] == [["batched_events"]]


def test_a_client_that_does_not_ask_sends_no_hello(fake_server):
    srv = fake_server(lambda m: [tokens_ev(m["id"], [5]), done_ev(m["id"])] if m["op"] == "generate" else [])
    with Client(srv.endpoint, timeout=5, batched_events=False) as c:
        assert c.generate([1]).tokens == [5]
    assert srv.hellos == []
