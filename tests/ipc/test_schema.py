"""Per-op request validation and the server event builders/readers (ipc.schema)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ipc.schema import (
    ADMIN_OPS, REQUEST_OPS, ProtocolError, done_event, error_event, reply_event, tokens_event, validate_event,
    validate_request,
)


def gen(**fields) -> dict:
    return {"v": 1, "op": "generate", "id": "r1", "prompt": [1, 2, 3], **fields}


def reject(obj) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        validate_request(obj)
    return info.value


def test_generate_defaults_are_filled_with_the_documented_values():
    assert validate_request({"v": 1, "op": "generate", "id": "r1", "prompt": [5]}) == {
        "v": 1, "op": "generate", "id": "r1", "model": None, "prompt": [5], "max_tokens": 16,
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "stop_token_ids": [], "stop": [],
        "ignore_eos": False, "deadline_ms": None, "tenant": "default", "priority": 0, "logprobs": False,
        "stream": True, "continuation": [], "pool": None, "speculative": None,
    }


def test_every_generate_field_is_kept_when_valid():
    full = gen(model="tiny", max_tokens=7, temperature=0.7, top_p=0.9, top_k=40, seed=2**64 - 1,
               stop_token_ids=[9], stop=[[1, 2], [3]], ignore_eos=True, deadline_ms=500, tenant="acme",
               priority=-3, logprobs=True, stream=False, continuation=[4, 5], pool="bulk",
               speculative="ngram", adapter="sql-lora")
    assert validate_request(full) == full


def test_list_defaults_are_not_shared_between_requests():
    a = validate_request(gen())
    a["stop"].append([1])
    a["continuation"].append(1)
    b = validate_request(gen())
    assert b["stop"] == [] and b["continuation"] == []


def test_integer_temperature_is_accepted_as_a_float():
    out = validate_request(gen(temperature=1))
    assert out["temperature"] == 1.0 and type(out["temperature"]) is float


@pytest.mark.parametrize("obj, reason", [
    (gen(max_tokens=True), "bad_type"),           # a bool is not an int
    (gen(stream=1), "bad_type"),                  # an int is not a bool
    (gen(logprobs="yes"), "bad_type"),
    (gen(prompt=[1, True]), "bad_type"),
    (gen(prompt=[1, 2.0]), "bad_type"),
    (gen(prompt="1,2"), "bad_type"),
    (gen(prompt=[]), "out_of_range"),
    (gen(prompt=[-1]), "out_of_range"),
    (gen(prompt=[2**31]), "out_of_range"),
    (gen(max_tokens=0), "out_of_range"),
    (gen(max_tokens=-5), "out_of_range"),
    (gen(temperature=-0.1), "out_of_range"),
    (gen(temperature=math.nan), "out_of_range"),
    (gen(temperature=math.inf), "out_of_range"),
    (gen(temperature=100.5), "out_of_range"),
    (gen(top_p=0.0), "out_of_range"),
    (gen(top_p=1.01), "out_of_range"),
    (gen(top_k=-1), "out_of_range"),
    (gen(seed=-1), "out_of_range"),
    (gen(seed=2**64), "out_of_range"),
    (gen(seed=1.0), "bad_type"),
    (gen(stop=[[]]), "out_of_range"),
    (gen(stop=[1, 2]), "bad_type"),
    (gen(stop=[[1]] * 17), "out_of_range"),
    (gen(stop=[[1] * 65]), "out_of_range"),
    (gen(stop_token_ids=list(range(257))), "out_of_range"),
    (gen(deadline_ms=0), "out_of_range"),
    (gen(tenant=""), "out_of_range"),
    (gen(tenant="a b"), "out_of_range"),
    (gen(tenant="x" * 65), "out_of_range"),
    (gen(tenant=None), "bad_type"),               # null only where the default is null
    (gen(model=3), "bad_type"),
    (gen(priority=101), "out_of_range"),
    (gen(continuation=[1, None]), "bad_type"),
    (gen(max_token=5), "unknown_field"),          # a typo must not fall back to a default
    ({"v": 1, "op": "generate", "id": "r1"}, "missing_field"),
    ({"v": 1, "op": "generat", "id": "r1"}, "unknown_op"),
    ({"v": 1, "op": 7, "id": "r1"}, "bad_type"),
    ({"v": 1, "id": "r1"}, "missing_field"),
    ({"op": "health", "id": "r1"}, "missing_field"),
    ({"v": 2, "op": "health", "id": "r1"}, "bad_version"),
    ({"v": True, "op": "health", "id": "r1"}, "bad_version"),
    ({"v": "1", "op": "health", "id": "r1"}, "bad_version"),
    ({"v": 1, "op": "cancel", "id": "r1", "target": "r0"}, "unknown_field"),
    ({"v": 1, "op": "load", "id": "r1"}, "missing_field"),
    ({"v": 1, "op": "replace", "id": "r1", "alias": "tiny"}, "missing_field"),
    ({"v": 1, "op": "replace", "id": "r1", "alias": "tiny", "package": ""}, "out_of_range"),
    ({"v": 1, "op": "load", "id": "r1", "model": "tiny", "package": "/p"}, "unknown_field"),  # `alias` names it
    ({"v": 1, "op": "unload", "id": "r1", "alias": "tiny", "deadline_s": -1}, "out_of_range"),
    ({"v": 1, "op": "drain", "id": "r1", "timeout_ms": -1}, "out_of_range"),
    ({"v": 1, "op": "health", "id": "r1", "auth": "t"}, "unknown_field"),   # auth only on admin ops
])
def test_invalid_request_is_rejected_with_its_reason_and_the_request_id(obj, reason):
    err = reject(obj)
    assert (err.code, err.reason, err.id) == (400, reason, "r1")


@pytest.mark.parametrize("obj, reason", [
    ([1, 2], "not_an_object"),
    ("generate", "not_an_object"),
    ({"v": 1, "op": "health"}, "missing_field"),
    ({"v": 1, "op": "health", "id": 5}, "bad_type"),
    ({"v": 1, "op": "health", "id": ""}, "out_of_range"),
    ({"v": 1, "op": "health", "id": "x" * 129}, "out_of_range"),
])
def test_request_without_a_readable_id_is_rejected_without_one(obj, reason):
    err = reject(obj)
    assert (err.reason, err.id) == (reason, None)


def test_error_message_names_the_offending_field():
    assert reject(gen(top_p=2)).message.startswith("top_p:")
    assert reject(gen(stop=[[1], [-2]])).message.startswith("stop[1]:")


def test_boundaries_that_are_allowed():
    ok = validate_request(gen(prompt=[0, 2**31 - 1], top_p=1.0, temperature=0, top_k=0, seed=0,
                              tenant="t" * 64, priority=-100, stop=[[1] * 64] * 16))
    assert ok["prompt"] == [0, 2**31 - 1]
    assert validate_request({"v": 1, "op": "health", "id": "x" * 128})["id"] == "x" * 128
    assert validate_request(gen(model=None, deadline_ms=None))["model"] is None


@pytest.mark.parametrize("op", REQUEST_OPS)
def test_every_op_has_a_minimal_valid_form(op):
    minimal = {"v": 1, "op": op, "id": "q"}
    if op == "generate":
        minimal["prompt"] = [1]
    if op in ("load", "unload", "replace", "rollback", "load_lora", "unload_lora"):
        minimal["alias"] = "tiny"
    if op in ("load", "replace", "load_lora"):
        minimal["package"] = "/srv/models/tiny-v2"
    out = validate_request(minimal)
    assert out["op"] == op and out["id"] == "q"
    assert ("auth" in out) == (op in ADMIN_OPS)


# ---------------------------------------------------------------- events


def test_tokens_event_accepts_numpy_and_round_trips_through_the_reader():
    ev = tokens_event("r1", np.array([3, 4], dtype=np.int32), logprobs=np.array([-0.5, -1.25], dtype=np.float32))
    assert ev == {"v": 1, "ev": "tokens", "id": "r1", "tokens": [3, 4], "logprobs": [-0.5, -1.25]}
    assert type(ev["tokens"][0]) is int
    assert validate_event(ev) is ev


def test_tokens_event_omits_logprobs_unless_given():
    assert "logprobs" not in tokens_event("r1", [1])


def test_done_event_shape_and_non_streamed_tokens():
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0}
    timing = {"ttft_ms": 1.5, "tpot_ms": 0.5, "e2e_ms": 2, "queue_ms": 0.1}
    ev = done_event("r1", "length", usage, timing, tokens=[7, 8])
    assert ev == {"v": 1, "ev": "done", "id": "r1", "finish_reason": "length", "usage": usage,
                  "timing": {"ttft_ms": 1.5, "tpot_ms": 0.5, "e2e_ms": 2.0, "queue_ms": 0.1}, "tokens": [7, 8]}
    assert validate_event(ev) is ev
    streamed = done_event("r1", "cancelled", usage, {"ttft_ms": None, "tpot_ms": None, "e2e_ms": 3})
    assert "tokens" not in streamed and validate_event(streamed) is streamed


def test_event_builders_refuse_what_the_protocol_cannot_carry():
    with pytest.raises(AssertionError):
        done_event("r1", "timeout", {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0},
                   {"ttft_ms": 1, "tpot_ms": 1, "e2e_ms": 1})
    with pytest.raises(AssertionError):
        error_event("r1", 418, "teapot", "no")
    with pytest.raises(AssertionError):
        error_event("r1", 400, "Not Snake", "no")
    with pytest.raises(AssertionError):
        tokens_event("r1", [1, 2], logprobs=[0.0])
    with pytest.raises(AssertionError):
        tokens_event("r1", [1], logprobs=[math.nan])
    with pytest.raises(AssertionError):
        reply_event("r1", "health", {"id": "other"})
    with pytest.raises(AssertionError):
        reply_event("r1", "nonsense", {})


def test_error_and_reply_events():
    err = error_event(None, 429, "queue_full", "too many waiting requests", retryable=True)
    assert err == {"v": 1, "ev": "error", "id": None, "code": 429, "reason": "queue_full",
                   "message": "too many waiting requests", "retryable": True}
    assert validate_event(err) is err
    rep = reply_event("h1", "health", {"ok": True, "chips": []})
    assert rep == {"v": 1, "ev": "health", "id": "h1", "ok": True, "chips": []}
    assert validate_event(rep) is rep


def test_protocol_error_becomes_a_non_retryable_400_event():
    err = reject(gen(max_tokens=-1))
    assert err.to_event() == {"v": 1, "ev": "error", "id": "r1", "code": 400, "reason": "out_of_range",
                              "message": err.message, "retryable": False}


def test_event_reader_ignores_unknown_fields_but_checks_known_ones():
    assert validate_event({"v": 1, "ev": "tokens", "id": "a", "tokens": [1], "chip": 0})["chip"] == 0
    bad = [
        ({"v": 2, "ev": "tokens", "id": "a", "tokens": [1]}, "bad_version"),
        ({"v": 1, "ev": "token", "id": "a", "tokens": [1]}, "unknown_op"),
        ({"v": 1, "ev": "tokens", "tokens": [1]}, "missing_field"),
        ({"v": 1, "ev": "tokens", "id": "a", "tokens": []}, "out_of_range"),
        ({"v": 1, "ev": "tokens", "id": "a", "tokens": [1], "logprobs": [0.0, 1.0]}, "bad_type"),
        ({"v": 1, "ev": "done", "id": "a", "finish_reason": "bored", "usage": {}, "timing": {}}, "out_of_range"),
        ({"v": 1, "ev": "done", "id": "a", "finish_reason": "eos",
          "usage": {"prompt_tokens": 1, "completion_tokens": 1}, "timing": {}}, "bad_type"),
        ({"v": 1, "ev": "error", "id": None, "code": "400", "reason": "x", "message": "m",
          "retryable": False}, "out_of_range"),
        ({"v": 1, "ev": "error", "id": None, "code": 400, "reason": "x", "message": "m",
          "retryable": 0}, "bad_type"),
    ]
    for obj, reason in bad:
        with pytest.raises(ProtocolError) as info:
            validate_event(obj)
        assert info.value.reason == reason, obj


# ---------------------------------------------------------------- hello


def test_hello_takes_capability_names_and_passes_unknown_ones():
    out = validate_request({"v": 1, "op": "hello", "id": "h", "capabilities": ["batched_events", "from_the_future"]})
    assert out["capabilities"] == ["batched_events", "from_the_future"]
    assert validate_request({"v": 1, "op": "hello", "id": "h"})["capabilities"] == []


@pytest.mark.parametrize("caps, reason", [
    ("batched_events", "bad_type"),
    ([1], "bad_type"),
    (["Batched-Events"], "out_of_range"),
    (["x" * 65], "out_of_range"),
    (["a"] * 17, "out_of_range"),
])
def test_hello_rejects_malformed_capabilities(caps, reason):
    with pytest.raises(ProtocolError) as e:
        validate_request({"v": 1, "op": "hello", "id": "h", "capabilities": caps})
    assert e.value.reason == reason and "capabilities" in e.value.message


def test_hello_reply_is_an_event_clients_read():
    ev = reply_event("h", "hello", {"capabilities": ["batched_events"]})
    assert validate_event(ev) == {"v": 1, "ev": "hello", "id": "h", "capabilities": ["batched_events"]}
