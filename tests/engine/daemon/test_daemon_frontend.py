"""The frontend's bookkeeping and back-pressure, over real inproc sockets and a fake clock."""

from __future__ import annotations

import itertools

import orjson
import pytest
import zmq

from engine.daemon import frontend as frontend_module
from engine.daemon.frontend import CLIENT_STALL_S, Frontend

_names = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def rig():
    ctx = zmq.Context()
    ep = f"inproc://fe{next(_names)}"
    clock = Clock()
    fe = Frontend(ctx, [ep], max_message_bytes=1 << 16, max_send_queue=4, clock=clock)
    clients = []

    def client(rcvhwm: int = 1000) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, rcvhwm)
        s.setsockopt(zmq.RCVTIMEO, 2000)
        s.connect(ep)
        clients.append(s)
        return s

    yield fe, client, clock
    for s in clients:
        s.close(0)
    fe.close(0)
    ctx.term()


def _request(fe: Frontend, sock: zmq.Socket, rid: str, stream: bool = True):
    sock.send(orjson.dumps({"v": 1, "op": "generate", "id": rid, "prompt": [1], "stream": stream}))
    for _ in range(100):
        got = fe.receive(0)
        if got:
            return got[0][0]
        sock.poll(10)
    raise AssertionError("request never arrived")


def _events(sock: zmq.Socket) -> list[dict]:
    out = []
    while sock.poll(50):
        out.append(orjson.loads(sock.recv()))
    return out


USAGE = {"prompt_tokens": 1, "completion_tokens": 3, "cached_tokens": 0}
TIMING = {"ttft_ms": 1.0, "tpot_ms": 1.0, "e2e_ms": 3.0}


def test_tokens_of_one_turn_leave_as_one_event_then_done(rig):
    fe, client, _ = rig
    s = client()
    conn = _request(fe, s, "a")
    assert fe.open(1, conn, "a", stream=True, logprobs=False)
    fe.emit(1, [5], None)
    fe.emit(1, [6, 7], None)
    assert fe.flush() == []
    fe.emit(1, [8], None)
    fe.finish(1, "length", USAGE, TIMING)
    evs = _events(s)
    assert [e["ev"] for e in evs] == ["tokens", "tokens", "done"]
    assert evs[0]["tokens"] == [5, 6, 7] and evs[1]["tokens"] == [8]
    assert evs[2]["finish_reason"] == "length" and "tokens" not in evs[2]
    assert fe.active() == 0


def test_non_streamed_request_gets_all_tokens_in_done(rig):
    fe, client, _ = rig
    s = client()
    conn = _request(fe, s, "b", stream=False)
    fe.open(1, conn, "b", stream=False, logprobs=True)
    fe.emit(1, [5, 6], [-0.5, -0.25])
    fe.flush()
    fe.finish(1, "eos", USAGE, TIMING)
    (ev,) = _events(s)
    assert ev["ev"] == "done" and ev["tokens"] == [5, 6] and ev["logprobs"] == [-0.5, -0.25]


def test_failure_sends_pending_tokens_before_the_error(rig):
    fe, client, _ = rig
    s = client()
    conn = _request(fe, s, "c")
    fe.open(1, conn, "c", stream=True, logprobs=False)
    fe.emit(1, [9], None)
    fe.fail(1, 500, "worker_failed", "chip died", False)
    evs = _events(s)
    assert [e["ev"] for e in evs] == ["tokens", "error"] and evs[1]["code"] == 500


def test_same_id_on_two_connections_is_two_requests_but_not_on_one(rig):
    fe, client, _ = rig
    s1, s2 = client(), client()
    c1, c2 = _request(fe, s1, "x"), _request(fe, s2, "x")
    assert fe.open(1, c1, "x", True, False)
    assert fe.open(2, c2, "x", True, False)
    assert not fe.open(3, c1, "x", True, False)
    assert fe.lookup(c1, "x") == 1 and fe.lookup(c2, "x") == 2


def test_a_gone_client_has_its_requests_returned_for_cancel(rig):
    fe, client, _ = rig
    s = client()
    conn = _request(fe, s, "d")
    fe.open(7, conn, "d", True, False)
    s.close(0)
    for _ in range(50):  # the ROUTER learns of the disconnect asynchronously
        fe.emit(7, [1], None)
        dead = fe.flush()
        if dead:
            break
        fe.sockets[0].poll(10)  # lets the ROUTER process the disconnect
        fe.receive(0)
    assert dead == [7]
    assert fe.active() == 0 and fe.counters.dropped_clients == 1


def _fill_until_blocked(fe: Frontend, rid: int) -> int:
    n = 0
    while not fe._blocked:
        fe.emit(rid, [n % 200], None)
        assert fe.flush() == []
        n += 1
        assert n < 100_000, "never blocked"
    return n


def test_a_slow_client_is_blocked_its_tokens_coalesce_and_none_are_lost(rig):
    fe, client, _ = rig
    s = client(rcvhwm=1)
    conn = _request(fe, s, "e")
    fe.open(1, conn, "e", True, False)
    sent = _fill_until_blocked(fe, 1)
    for i in range(50):  # while blocked, tokens accumulate instead of being sent
        fe.emit(1, [i], None)
        assert fe.flush() == []
    fe.finish(1, "length", USAGE, TIMING)
    assert fe.counters.blocked_clients == 1
    toks: list[int] = []
    evs: list[dict] = []
    while True:  # the client reads again: everything arrives, in order, the tail coalesced
        for ev in _events(s):
            evs.append(ev)
            toks += ev.get("tokens", [])
        fe.flush()
        if evs and evs[-1]["ev"] == "done":
            break
    assert toks == [n % 200 for n in range(sent)] + list(range(50))
    assert not fe._blocked and fe.counters.dropped_clients == 0
    assert max(len(e.get("tokens", [])) for e in evs) >= 50  # the blocked period left as one event


def test_a_client_stalled_too_long_is_dropped(rig):
    fe, client, clock = rig
    s = client(rcvhwm=1)
    conn = _request(fe, s, "f")
    fe.open(1, conn, "f", True, False)
    _fill_until_blocked(fe, 1)
    clock.t += CLIENT_STALL_S / 2
    assert fe.flush() == []
    clock.t += CLIENT_STALL_S
    assert fe.flush() == [1]
    assert fe.counters.dropped_clients == 1 and fe.active() == 0


def test_overflowing_terminal_events_drop_the_client(rig):
    fe, client, _ = rig
    s = client(rcvhwm=1)
    conns = []
    for i in range(8):
        conns.append(_request(fe, s, f"g{i}"))
        fe.open(i, conns[-1], f"g{i}", True, False)
    _fill_until_blocked(fe, 0)
    for i in range(1, 8):  # seven terminal events queue behind a full pipe; the overflow bound is 4
        fe.finish(i, "length", USAGE, TIMING)
    assert fe.flush() == [0]
    assert fe.counters.dropped_clients == 1


def test_text_deltas_coalesce_with_their_tokens_and_a_text_only_tail_is_sent(rig):
    fe, client, _ = rig
    s = client()
    conn = _request(fe, s, "t")
    assert fe.open(1, conn, "t", stream=True, logprobs=False, text=True)
    fe.emit(1, [104], None, "h")
    fe.emit(1, [195], None, "")  # a lead byte: the id now, the character later
    assert fe.flush() == []
    fe.emit(1, [169], None, "é")
    fe.flush()
    fe.emit(1, [], None, "EN")  # held stop-string prefix released at the end
    fe.finish(1, "eos", USAGE, TIMING)
    evs = _events(s)
    assert [(e["ev"], e.get("tokens"), e.get("text")) for e in evs] == [
        ("tokens", [104, 195], "h"), ("tokens", [169], "é"), ("tokens", [], "EN"), ("done", None, None)]


def test_non_streamed_done_carries_the_whole_text_even_when_empty(rig):
    fe, client, _ = rig
    s = client()
    for rid, cid in ((1, "n1"), (2, "n2")):
        conn = _request(fe, s, cid, stream=False)
        assert fe.open(rid, conn, cid, stream=False, logprobs=True, text=True)
    fe.emit(1, [104, 105], [-0.5, -0.25], "hi")
    fe.emit(1, [], None, "!")
    fe.finish(1, "stop", USAGE, TIMING)
    fe.finish(2, "eos", USAGE, TIMING)  # EOS first: no tokens, empty text
    a, b = _events(s)
    assert (a["tokens"], a["logprobs"], a["text"]) == ([104, 105], [-0.5, -0.25], "hi!")
    assert (b["tokens"], b["text"]) == ([], "")
    conn = _request(fe, s, "plain", stream=False)
    assert fe.open(3, conn, "plain", stream=False, logprobs=False)  # no tokenizer: no text field
    fe.emit(3, [1], None)
    fe.finish(3, "length", USAGE, TIMING)
    (c,) = _events(s)
    assert "text" not in c and c["tokens"] == [1]


def _hello(fe: Frontend, sock: zmq.Socket, capabilities: list[str]) -> dict:
    """Send `hello` and return its reply; the frontend answers it itself (no request reaches the ops)."""
    sock.send(orjson.dumps({"v": 1, "op": "hello", "id": "h", "capabilities": capabilities}))
    for _ in range(100):
        assert fe.receive(0) == []
        if sock.poll(10):
            frames = sock.recv_multipart()
            assert len(frames) == 1
            return orjson.loads(frames[0])
    raise AssertionError("no hello reply")


def _messages(sock: zmq.Socket) -> list[list[dict]]:
    """Every waiting message, read whole: a list of the events in its frames."""
    out = []
    while sock.poll(50):
        out.append([orjson.loads(f) for f in sock.recv_multipart()])
    return out


def _two_streams_one_turn(fe: Frontend, sock: zmq.Socket) -> list[list[dict]]:
    c1, c2 = _request(fe, sock, "a"), _request(fe, sock, "b")
    fe.open(1, c1, "a", True, False)
    fe.open(2, c2, "b", True, False)
    fe.emit(1, [5], None)
    fe.emit(2, [6], None)
    fe.flush()
    return _messages(sock)


def test_without_hello_every_message_holds_exactly_one_event(rig):
    fe, client, _ = rig
    msgs = _two_streams_one_turn(fe, client())
    assert [[e["id"] for e in m] for m in msgs] == [["a"], ["b"]]


def test_a_connection_that_asks_for_batched_events_gets_a_turn_in_one_message(rig):
    fe, client, _ = rig
    s = client()
    assert _hello(fe, s, ["batched_events", "not_a_capability"]) == {
        "v": 1, "ev": "hello", "id": "h", "capabilities": ["batched_events"]}
    msgs = _two_streams_one_turn(fe, s)
    assert [[(e["id"], e["tokens"]) for e in m] for m in msgs] == [[("a", [5]), ("b", [6])]]
    other = client()  # the capability is the connection's, not the socket's
    conn = _request(fe, other, "c")
    conn2 = _request(fe, other, "d")
    fe.open(3, conn, "c", True, False)
    fe.open(4, conn2, "d", True, False)
    fe.emit(3, [1], None)
    fe.emit(4, [2], None)
    fe.flush()
    assert [len(m) for m in _messages(other)] == [1, 1]


def test_hello_without_the_capability_takes_it_back(rig):
    fe, client, _ = rig
    s = client()
    _hello(fe, s, ["batched_events"])
    assert _hello(fe, s, [])["capabilities"] == []
    assert [len(m) for m in _two_streams_one_turn(fe, s)] == [1, 1]


def test_connections_beyond_the_bound_fall_back_to_one_event_per_message(rig, monkeypatch):
    monkeypatch.setattr(frontend_module, "MAX_BATCHED_CONNS", 1)
    fe, client, _ = rig
    old, new = client(), client()
    _hello(fe, old, ["batched_events"])
    _hello(fe, new, ["batched_events"])
    assert [len(m) for m in _two_streams_one_turn(fe, old)] == [1, 1]
