"""v1 framing over real processes: a client that never sends `hello` reads each message whole and finds one
event in each, directly and through a balancer; a connection that asks for batched events gets several
events per message (and the balancer's own links to its backends ask)."""

from __future__ import annotations

import orjson
import pytest
import zmq
from balancer_procs import tcp_daemon

pytestmark = pytest.mark.integration

STREAMS = 16
TOKENS = 24


def _whole_messages(endpoint: str, hello: bool) -> tuple[list[list[dict]], dict | None]:
    """Start STREAMS streams on one plain DEALER; every message read whole until each has its terminal event."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        if hello:
            sock.send(orjson.dumps({"v": 1, "op": "hello", "id": "h", "capabilities": ["batched_events"]}))
        for i in range(STREAMS):
            sock.send(orjson.dumps({"v": 1, "op": "generate", "id": f"s{i}", "prompt": [1 + i, 2],
                                    "max_tokens": TOKENS, "ignore_eos": True}))
        messages, reply, open_ = [], None, {f"s{i}" for i in range(STREAMS)}
        while open_:
            assert sock.poll(120_000), f"no event for 120 s; still open: {sorted(open_)}"
            events = [orjson.loads(f) for f in sock.recv_multipart()]
            if events[0]["id"] == "h":
                reply = events[0]
                continue
            messages.append(events)
            open_ -= {e["id"] for e in events if e["ev"] in ("done", "error")}
        return messages, reply
    finally:
        sock.close(0)


def _check_streams(messages: list[list[dict]]) -> None:
    tokens: dict[str, int] = {}
    done: dict[str, dict] = {}
    for m in messages:
        for e in m:
            assert e["ev"] in ("tokens", "done"), e
            if e["ev"] == "tokens":
                tokens[e["id"]] = tokens.get(e["id"], 0) + len(e["tokens"])
            else:
                assert e["id"] not in done
                done[e["id"]] = e
    assert len(done) == STREAMS
    for rid, ev in done.items():
        assert ev["usage"]["completion_tokens"] == tokens.get(rid, 0) == TOKENS, rid


def _frontend(endpoint_client) -> dict:
    with endpoint_client(timeout=30) as c:
        return c.stats()["frontend"]


def test_a_client_without_hello_gets_one_event_per_message_from_a_daemon_and_a_balancer(daemon, balancer):
    d, ep = tcp_daemon(daemon, backend="stub", chips=2)
    b = balancer(backends=[ep])
    for target in (d.endpoint, b.endpoint):
        messages, reply = _whole_messages(target, hello=False)
        assert reply is None
        assert max(len(m) for m in messages) == 1, target
        _check_streams(messages)
    # the balancer's link to the daemon asked for batched events: the daemon sent it several per message
    front = _frontend(d.client)
    assert front["hellos"] >= 1 and front["batched_messages"] >= 1


def test_a_connection_that_asks_gets_batched_events_with_nothing_lost(daemon):
    d = daemon(backend="stub", chips=2)
    messages, reply = _whole_messages(d.endpoint, hello=True)
    assert reply == {"v": 1, "ev": "hello", "id": "h", "capabilities": ["batched_events"]}
    assert max(len(m) for m in messages) > 1
    _check_streams(messages)
