"""A balancer answers like a daemon: malformed input, duplicate ids, admin rights, models, vanished
clients (cancelled upstream), and a restarted balancer serves at once."""

from __future__ import annotations

import os
import stat
import time

import pytest
import zmq
from balancer_procs import tcp_daemon

from engine.client import open_dealer
from engine.errors import Forbidden, InvalidRequest, ModelNotFound, Unavailable
from ipc.codec import decode_event, encode

pytestmark = pytest.mark.integration


def test_balancer_speaks_the_daemon_protocol(daemon, balancer):
    d, e = tcp_daemon(daemon)
    b = balancer(backends=[e])
    with b.client(timeout=10) as c:
        for raw, reason in ((b"{nope", "bad_json"), (b'{"v":1,"op":"generate","id":"q","prompt":[1],"max_token":3}',
                                                      "unknown_field")):
            rid = "q" if b'"id"' in raw else None
            c.expect(rid)
            c.send_raw(raw)
            ev = c.next_event(rid)
            assert (ev["ev"], ev["code"], ev["reason"]) == ("error", 400, reason)
        with pytest.raises(InvalidRequest):
            c.generate([1], max_tokens=1, temperature=-1.0)
        assert c.call("models")["models"][0]["alias"] == "tiny"
        with pytest.raises(Forbidden):  # tcp:// without an admin key
            c.call("drain")
        s1 = c.stream([1, 2], id="same", max_tokens=3)
        with pytest.raises(InvalidRequest) as info:
            c.generate([1], id="same", max_tokens=1)
        assert info.value.reason == "duplicate_id"
        assert sum(len(x) for x in s1) == 3
        assert c.generate([5], max_tokens=2).finish_reason == "length"
    with d.client(timeout=10) as dc, pytest.raises(ModelNotFound) as info:  # ipc://: admin, but no backends
        dc.call("drain", backend=e)
    assert info.value.reason == "backend_not_found"


def test_vanished_client_is_cancelled_upstream_and_a_restarted_balancer_serves_at_once(daemon, balancer):
    d, e = tcp_daemon(daemon, backend="sim", backend_options={"decode_base_ms": 5.0})
    b = balancer(backends=[e])
    ctx = zmq.Context.instance()
    sock = open_dealer(ctx, b.endpoint, batched_events=False)
    sock.send(encode({"v": 1, "op": "generate", "id": "gone", "prompt": [1, 2], "max_tokens": 1500,
                      "ignore_eos": True}))
    assert sock.poll(10_000) and decode_event(sock.recv())["ev"] == "tokens"
    sock.close(0)
    deadline = time.monotonic() + 10
    with d.client(timeout=5) as dc:
        while dc.stats()["scheduler"]["counters"].get("cancelled", 0) < 1:
            assert time.monotonic() < deadline, "the vanished client's stream was not cancelled upstream"
            time.sleep(0.05)
        assert dc.health()["active_requests"] == 0
    with b.client(timeout=5) as c:
        assert c.stats()["balancer"]["counters"]["cancelled_dead_clients"] == 1
    assert b.stop() == 0
    b2 = balancer(backends=[e], endpoint=b.endpoint)
    with b2.client(timeout=10) as c:
        assert c.generate([3, 4], max_tokens=3).finish_reason == "length"


def test_a_429_from_one_daemon_is_retried_on_another(daemon, balancer):
    d1, e1 = tcp_daemon(daemon, settings={"admission.max_waiting_requests": 0})  # rejects everything: 429
    d2, e2 = tcp_daemon(daemon)
    b = balancer(backends=[e1, e2], policy="round-robin")
    with b.client(timeout=10) as c:
        for i in range(6):
            assert c.generate([i + 1, 2], max_tokens=3).finish_reason == "length"
        st = c.stats()
    with d1.client(timeout=5) as dc:
        rejected = dc.stats()["scheduler"]["counters"].get("rejected", 0)
    assert rejected >= 1 and st["balancer"]["counters"]["retries"] == rejected
    assert st["backends"][e2]["frontend"]["requests"] == 6


def test_drain_and_resume_over_ipc(daemon, balancer, short_dir):
    d, e = tcp_daemon(daemon)
    b = balancer(backends=[e], endpoint=f"ipc://{short_dir}/bal.sock")
    assert stat.S_IMODE(os.stat(f"{short_dir}/bal.sock").st_mode) == 0o600
    with b.client(timeout=10) as c:  # ipc:// is an admin connection
        assert c.call("drain") == {"accepting": False}
        with pytest.raises(Unavailable) as info:
            c.generate([1], max_tokens=1)
        assert info.value.reason == "draining" and info.value.retryable
        assert c.health()["ok"] is False
        assert c.call("resume") == {"accepting": True}
        assert c.generate([1], max_tokens=1).finish_reason == "length"


def test_text_prompts_through_a_balancer_read_as_direct(daemon, balancer):
    d, e = tcp_daemon(daemon, backend="ref")
    b = balancer(backends=[e])
    kw = dict(max_tokens=24, seed=3, temperature=0.7, ignore_eos=True)
    with d.client(timeout=30) as dc:
        direct = dc.generate("Grüße, world", **kw)
    with b.client(timeout=30) as c:
        streamed = "".join(c.stream_text("Grüße, world", **kw))
        whole = c.generate("Grüße, world", **kw)
        stopped = c.generate("Grüße, world", stop=[direct.text[3:5]], **kw)
    assert len(direct.text) >= 5 and streamed == whole.text == direct.text
    assert whole.tokens == direct.tokens and whole.usage["prompt_tokens"] == direct.usage["prompt_tokens"]
    assert stopped.finish_reason == "stop" and stopped.text == direct.text[:direct.text.index(direct.text[3:5])]
