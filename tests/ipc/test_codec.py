"""The wire codec: bytes in, validated dicts or one ProtocolError out (ipc.codec)."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc.codec import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, ProtocolError, decode_event, decode_request, encode
from ipc.schema import OP_FIELDS, done_event, error_event, reply_event, tokens_event, validate_request

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_contract_constants():
    assert PROTOCOL_VERSION == 1
    assert MAX_MESSAGE_BYTES == 1 << 20


@pytest.mark.parametrize("msg", [
    {"v": 1, "op": "generate", "id": "g", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.5,
     "top_p": 0.95, "top_k": 5, "seed": 12345678901234567890, "stop_token_ids": [2], "stop": [[7, 8]],
     "ignore_eos": True, "deadline_ms": 1000, "tenant": "acme", "priority": 5, "logprobs": True,
     "stream": False, "continuation": [9], "model": "tiny"},
    {"v": 1, "op": "cancel", "id": "g"},
    {"v": 1, "op": "health", "id": "h"},
    {"v": 1, "op": "stats", "id": "s"},
    {"v": 1, "op": "load", "id": "a", "alias": "m2", "package": "/srv/m2", "auth": "secret"},
    {"v": 1, "op": "drain", "id": "d", "timeout_ms": 5000, "auth": None},
])
def test_valid_request_round_trips(msg):
    assert decode_request(encode(msg)) == validate_request(msg)
    decoded = decode_request(encode(msg))
    assert {k: decoded[k] for k in msg} == msg


def test_encode_accepts_numpy_values():
    data = encode({"v": 1, "ev": "tokens", "id": "x", "tokens": np.array([1, 2], dtype=np.int32),
                   "n": np.int64(3)})
    assert orjson.loads(data) == {"v": 1, "ev": "tokens", "id": "x", "tokens": [1, 2], "n": 3}


# The malformed-message table: raw bytes -> (reason, id the error carries).
MALFORMED = [
    (b"", "bad_json", None),
    (b"not json", "bad_json", None),
    (b'{"v":1,"op":"health","id":"a"', "bad_json", None),                 # truncated
    (b'\xff\xfe{"v":1}', "bad_json", None),                                # not UTF-8
    (b'{"v":1,"op":"generate","id":"n","prompt":[1],"temperature":NaN}', "bad_json", None),
    (b'[' * 5000, "bad_json", None),                                       # nesting bomb
    (b'[1,2,3]', "not_an_object", None),
    (b'"generate"', "not_an_object", None),
    (b'null', "not_an_object", None),
    (b'{"v":1,"op":"health"}', "missing_field", None),
    (b'{"v":1,"op":"health","id":42}', "bad_type", None),
    (b'{"op":"health","id":"a"}', "missing_field", "a"),
    (b'{"v":2,"op":"health","id":"a"}', "bad_version", "a"),
    (b'{"v":"1","op":"health","id":"a"}', "bad_version", "a"),
    (b'{"v":1,"op":"explode","id":"a"}', "unknown_op", "a"),
    (b'{"v":1,"op":"generate","id":"a","prompt":[1],"max_tokens":-1}', "out_of_range", "a"),
    (b'{"v":1,"op":"generate","id":"a","prompt":[1],"max_tokens":1.5}', "bad_type", "a"),
    (b'{"v":1,"op":"generate","id":"a","prompt":[1],"max_tokens":"8"}', "bad_type", "a"),
    (b'{"v":1,"op":"generate","id":"a","prompt":[1],"temperature":-1}', "out_of_range", "a"),
    (b'{"v":1,"op":"generate","id":"a","prompt":[1],"seed":18446744073709551616}', "bad_type", "a"),
    (b'{"v":1,"op":"generate","id":"a","prompt":[1],"stream":1}', "bad_type", "a"),
    (b'{"v":1,"op":"generate","id":"a","prompt":[]}', "out_of_range", "a"),
    (b'{"v":1,"op":"generate","id":"a","prompt":[1,-2]}', "out_of_range", "a"),
    (b'{"v":1,"op":"generate","id":"a","prompt":[1],"bogus":1}', "unknown_field", "a"),
]


@pytest.mark.parametrize("data, reason, rid", MALFORMED)
def test_malformed_message_gets_its_reason(data, reason, rid):
    with pytest.raises(ProtocolError) as info:
        decode_request(data)
    assert (info.value.code, info.value.reason, info.value.id) == (400, reason, rid)
    ev = info.value.to_event()
    assert decode_event(encode(ev)) == ev  # the answer itself is a valid event


def test_oversized_message_is_refused_unparsed_but_keeps_its_id():
    huge = b'{"v":1,"op":"generate","id":"big-1","prompt":[' + b"1," * 600_000 + b"1]}"
    assert len(huge) > MAX_MESSAGE_BYTES
    with pytest.raises(ProtocolError) as info:
        decode_request(huge)
    assert (info.value.reason, info.value.id) == ("too_large", "big-1")
    # The limit is the caller's: the same message passes with a larger one.
    assert len(decode_request(huge, max_bytes=len(huge))["prompt"]) == 600_001


def test_max_bytes_boundary_is_inclusive():
    data = encode({"v": 1, "op": "health", "id": "h"})
    assert decode_request(data, max_bytes=len(data))["op"] == "health"
    with pytest.raises(ProtocolError) as info:
        decode_request(data, max_bytes=len(data) - 1)
    assert info.value.reason == "too_large" and info.value.id == "h"


@pytest.mark.parametrize("data", ["{}", None, 42, {"v": 1}])
def test_non_bytes_input_is_a_protocol_error(data):
    with pytest.raises(ProtocolError):
        decode_request(data)


def test_memoryview_and_bytearray_are_accepted():
    data = encode({"v": 1, "op": "stats", "id": "s"})
    assert decode_request(memoryview(data))["op"] == "stats"
    assert decode_request(bytearray(data))["op"] == "stats"


@SETTINGS
@given(st.binary(max_size=512))
def test_garbage_bytes_raise_only_protocol_error(data):
    try:
        decode_request(data)
    except ProtocolError as e:
        assert e.code == 400
    try:
        decode_event(data)
    except ProtocolError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)


@SETTINGS
@given(json_values)
def test_any_json_document_raises_only_protocol_error(value):
    try:
        decode_request(encode(value))
    except ProtocolError:
        pass


@SETTINGS
@given(st.fixed_dictionaries({"op": st.sampled_from(sorted(OP_FIELDS)), "id": st.text(min_size=1, max_size=8)})
       .flatmap(lambda base: st.tuples(st.just(base), st.sampled_from(sorted(OP_FIELDS[base["op"]]) or ["x"]),
                                       json_values)))
def test_any_value_in_any_field_is_accepted_or_one_protocol_error(case):
    """Validated directly (no safety net in the codec) so a checker bug would surface as a crash."""
    base, field, value = case
    msg = {"v": 1, **base}
    if base["op"] == "generate":
        msg["prompt"] = [1]
    if base["op"] in ("load", "replace"):
        msg.setdefault("package", "/p")
    if base["op"] in ("load", "unload", "replace", "rollback"):
        msg.setdefault("alias", "m")
    msg[field] = value
    try:
        out = validate_request(msg)
    except ProtocolError as e:
        assert e.id == base["id"] and e.code == 400
        return
    assert out[field] == value  # accepted values are passed through unchanged


def test_decode_event_reads_every_builder():
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}
    timing = {"ttft_ms": 1.0, "tpot_ms": 0.0, "e2e_ms": 1.0}
    for ev in (tokens_event("a", [1]), done_event("a", "eos", usage, timing),
               error_event("a", 503, "draining", "board is draining", retryable=True),
               reply_event("a", "stats", {"requests": 3})):
        assert decode_event(encode(ev)) == ev


def test_decode_event_rejects_a_request():
    with pytest.raises(ProtocolError):
        decode_event(encode({"v": 1, "op": "health", "id": "h"}))


def test_trusted_events_are_parsed_without_field_checks():
    from ipc.codec import decode_trusted_event

    ev = {"v": 1, "ev": "tokens", "id": "r1", "tokens": [1], "text": "a"}
    assert decode_trusted_event(orjson.dumps(ev)) == ev
    assert decode_trusted_event(b'{"ev": "tokens", "tokens": "not checked"}')["tokens"] == "not checked"
    for bad in (b"[1]", b"{nope", "text", b"x" * (MAX_MESSAGE_BYTES + 1)):
        with pytest.raises(ProtocolError):
            decode_trusted_event(bad)
