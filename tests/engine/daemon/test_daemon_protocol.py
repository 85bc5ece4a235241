"""Malformed and hostile messages against a real daemon: each gets its 400-class error, the daemon keeps serving."""

from __future__ import annotations

import orjson
import pytest
import zmq

from tools.load.ports import free_port

pytestmark = pytest.mark.integration

MAX_MSG = 65536
VALID = {"v": 1, "op": "generate", "id": "ok", "prompt": [1, 2, 3], "max_tokens": 4, "stream": False}


def _gen(**fields) -> bytes:
    msg = dict(VALID, id="bad")
    msg.update(fields)
    return orjson.dumps({k: v for k, v in msg.items() if v is not _DROP})


_DROP = object()

# (name, raw bytes, expected code, expected reason or None (any), expected id)
CASES = [
    ("not json", b"this is not json", 400, "bad_json", None),
    ("binary garbage", b"\xff\xfe\x00\x01", 400, "bad_json", None),
    ("truncated json", b'{"v": 1, "op": "generate", "id": "t", "prompt": [1, 2', 400, "bad_json", None),
    ("json array", b"[1, 2, 3]", 400, "not_an_object", None),
    ("json string", b'"generate"', 400, "not_an_object", None),
    ("json number", b"42", 400, "not_an_object", None),
    ("missing id", orjson.dumps({"v": 1, "op": "health"}), 400, "missing_field", None),
    ("id wrong type", orjson.dumps({"v": 1, "op": "health", "id": 7}), 400, "bad_type", None),
    ("id empty", orjson.dumps({"v": 1, "op": "health", "id": ""}), 400, "out_of_range", None),
    ("missing version", _gen(v=_DROP), 400, "missing_field", "bad"),
    ("wrong version", _gen(v=2), 400, "bad_version", "bad"),
    ("version as bool", _gen(v=True), 400, "bad_version", "bad"),
    ("unknown op", orjson.dumps({"v": 1, "op": "frobnicate", "id": "bad"}), 400, "unknown_op", "bad"),
    ("op wrong type", orjson.dumps({"v": 1, "op": 3, "id": "bad"}), 400, "bad_type", "bad"),
    ("unknown field", _gen(max_token=5), 400, "unknown_field", "bad"),
    ("missing prompt", _gen(prompt=_DROP), 400, "missing_field", "bad"),
    ("prompt wrong type", _gen(prompt="hello"), 400, "bad_type", "bad"),
    ("prompt empty", _gen(prompt=[]), 400, "out_of_range", "bad"),
    ("prompt negative id", _gen(prompt=[1, -2]), 400, "out_of_range", "bad"),
    ("prompt float id", _gen(prompt=[1, 2.5]), 400, "bad_type", "bad"),
    ("negative max_tokens", _gen(max_tokens=-1), 400, "out_of_range", "bad"),
    ("zero max_tokens", _gen(max_tokens=0), 400, "out_of_range", "bad"),
    ("max_tokens as string", _gen(max_tokens="5"), 400, "bad_type", "bad"),
    ("NaN temperature", b'{"v":1,"op":"generate","id":"bad","prompt":[1],"temperature":NaN}', 400, "bad_json", None),
    ("negative temperature", _gen(temperature=-0.5), 400, "out_of_range", "bad"),
    ("top_p zero", _gen(top_p=0.0), 400, "out_of_range", "bad"),
    ("negative seed", _gen(seed=-1), 400, "out_of_range", "bad"),
    ("stream not bool", _gen(stream="yes"), 400, "bad_type", "bad"),
    ("empty stop sequence", _gen(stop=[[]]), 400, "out_of_range", "bad"),
    ("bad tenant name", _gen(tenant="no spaces allowed"), 400, "out_of_range", "bad"),
    ("zero deadline", _gen(deadline_ms=0), 400, "out_of_range", "bad"),
    ("oversized frame", _gen(prompt=[7] * (MAX_MSG // 2)), 400, "too_large", "bad"),
    ("prompt longer than the model", _gen(prompt=[5] * 3000), 400, None, "bad"),
    ("token id outside the vocabulary", _gen(prompt=[1, 100000]), 400, None, "bad"),
    ("unknown model", _gen(model="no-such-model"), 404, "model_not_found", "bad"),
    ("load of a package that does not exist", orjson.dumps({"v": 1, "op": "load", "id": "bad", "alias": "x",
                                                             "package": "/no/such/package"}), 400,
     "package_rejected", "bad"),
    ("unload of an alias not loaded", orjson.dumps({"v": 1, "op": "unload", "id": "bad", "alias": "x"}), 404,
     "model_not_found", "bad"),
]


@pytest.fixture
def served(daemon):
    d = daemon(backend="stub", chips=1, settings={"server.max_message_bytes": MAX_MSG},
               backend_options={"max_seq": 2048})
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.connect(d.endpoint)
    yield d, s
    s.close(0)
    ctx.term()


def _roundtrip(s: zmq.Socket, data: bytes) -> dict:
    s.send(data)
    return orjson.loads(s.recv())


def test_table_has_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_each_malformed_message_gets_its_error_and_the_daemon_keeps_serving(served):
    d, s = served
    errors_before = d.client(timeout=5).stats()["frontend"]["protocol_errors"]
    for name, data, code, reason, rid in CASES:
        ev = _roundtrip(s, data)
        assert ev["ev"] == "error", (name, ev)
        assert ev["code"] == code, (name, ev)
        if reason is not None:
            assert ev["reason"] == reason, (name, ev)
        assert ev["id"] == rid, (name, ev)
        assert ev["retryable"] is False, (name, ev)
        ok = _roundtrip(s, orjson.dumps(VALID))
        assert ok["ev"] == "done" and ok["id"] == "ok" and len(ok["tokens"]) == 4, (name, ok)
    # Exactly the messages the frontend refused itself (not those the core or the op table refused).
    counted = d.client(timeout=5).stats()["frontend"]["protocol_errors"] - errors_before
    assert counted == sum(1 for c in CASES if c[3] in (
        "bad_json", "not_an_object", "missing_field", "bad_type", "out_of_range", "bad_version",
        "unknown_op", "unknown_field", "too_large")), counted


def test_duplicate_in_flight_id_is_rejected_without_disturbing_the_first(served):
    d, s = served
    first = dict(VALID, id="dup", max_tokens=2000, stream=True)
    s.send(orjson.dumps(first))
    s.send(orjson.dumps(first))
    events = []
    while True:
        ev = orjson.loads(s.recv())
        events.append(ev)
        if ev["ev"] == "done":
            break
    errors = [e for e in events if e["ev"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == 400 and errors[0]["reason"] == "duplicate_id"
    tokens = [t for e in events if e["ev"] == "tokens" for t in e["tokens"]]
    assert len(tokens) == 2000 and events[-1]["usage"]["completion_tokens"] == 2000
    # Once finished, the id may be used again.
    again = _roundtrip(s, orjson.dumps(dict(VALID, id="dup")))
    assert again["ev"] == "done"


def test_cancel_of_unknown_id_is_harmless(served):
    d, s = served
    s.send(orjson.dumps({"v": 1, "op": "cancel", "id": "never-sent"}))
    assert _roundtrip(s, orjson.dumps(VALID))["ev"] == "done"
    assert not s.poll(300), f"a cancel of an unknown id was answered: {s.recv()!r}"  # a cancel has no reply


def test_admin_ops_are_refused_on_tcp_and_allowed_on_ipc(daemon):
    port = free_port()
    d = daemon(backend="stub", chips=1, extra=["--endpoint", f"tcp://127.0.0.1:{port}"])
    from engine.client import Client
    from engine.errors import Forbidden

    with Client(f"tcp://127.0.0.1:{port}", timeout=10) as remote:
        assert remote.generate([1, 2], max_tokens=3).finish_reason == "length"  # serving works over tcp
        with pytest.raises(Forbidden) as e:
            remote.call("drain")
        assert e.value.code == 403
    with d.client(timeout=10) as local:
        assert local.call("drain") == {"accepting": False}
        assert local.call("resume") == {"accepting": True}
