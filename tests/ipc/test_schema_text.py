"""Text in the wire schema: `text` vs `prompt`, string stops, `text` in tokens/done events."""

from __future__ import annotations

import pytest

from ipc.codec import decode_request, encode
from ipc.schema import MAX_STOP_STRING_CHARS, ProtocolError, done_event, tokens_event, validate_event, validate_request

USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}
TIMING = {"ttft_ms": 1.0, "tpot_ms": None, "e2e_ms": 2.0}


def req(**fields) -> dict:
    return {"v": 1, "op": "generate", "id": "r1", **fields}


def reject(obj) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        validate_request(obj)
    return info.value


def test_text_is_an_alternative_to_prompt():
    out = validate_request(req(text="héllo"))
    assert out["text"] == "héllo" and "prompt" not in out
    out = validate_request(req(prompt=[1]))
    assert out["prompt"] == [1] and "text" not in out
    assert validate_request(req(text=""))["text"] == ""  # the daemon decides (BOS-only prompts exist)


def test_text_and_prompt_together_is_a_400_naming_both():
    err = reject(req(text="hi", prompt=[1]))
    assert (err.code, err.reason, err.id) == (400, "conflicting_fields", "r1")
    assert "prompt" in err.message and "text" in err.message and "both" in err.message


def test_neither_text_nor_prompt_is_a_400_naming_both():
    err = reject(req(max_tokens=3))
    assert (err.code, err.reason) == (400, "missing_field")
    assert err.message.startswith("prompt or text:")


@pytest.mark.parametrize("value, reason", [
    (["a"], "bad_type"), (None, "bad_type"), (5, "bad_type"), (b"x".decode(), None),
])
def test_text_must_be_a_string(value, reason):
    if reason is None:
        assert validate_request(req(text=value))["text"] == value
    else:
        err = reject(req(text=value))
        assert err.reason == reason and err.message.startswith("text:")


def test_stop_accepts_strings_token_lists_and_a_mix():
    out = validate_request(req(text="x", stop=["\n\n", [7, 8], "END"]))
    assert out["stop"] == ["\n\n", [7, 8], "END"]
    assert validate_request(req(text="x", stop=["s" * MAX_STOP_STRING_CHARS] * 16))["stop"][0] == \
        "s" * MAX_STOP_STRING_CHARS


@pytest.mark.parametrize("stop, reason, where", [
    ([""], "out_of_range", "stop[0]:"),
    (["ok", "s" * (MAX_STOP_STRING_CHARS + 1)], "out_of_range", "stop[1]:"),
    ([3], "bad_type", "stop[0]:"),
    ([None], "bad_type", "stop[0]:"),
    ([{"s": 1}], "bad_type", "stop[0]:"),
    (["a", ["b"]], "bad_type", "stop[1]:"),
    ("END", "bad_type", "stop:"),               # a bare string is not a list of stops
    (["a"] * 17, "out_of_range", "stop:"),
])
def test_bad_stop_values(stop, reason, where):
    err = reject(req(prompt=[1], stop=stop))
    assert (err.reason, err.id) == (reason, "r1")
    assert err.message.startswith(where), err.message


def test_codec_path_answers_conflicting_fields_with_the_id():
    with pytest.raises(ProtocolError) as info:
        decode_request(encode(req(text="a", prompt=[1])), max_bytes=1 << 20)
    assert info.value.to_event()["reason"] == "conflicting_fields"
    assert info.value.to_event()["id"] == "r1"


def test_tokens_event_with_text_and_text_only_final_delta():
    ev = tokens_event("r1", [104, 105], text="hi")
    assert ev == {"v": 1, "ev": "tokens", "id": "r1", "tokens": [104, 105], "text": "hi"}
    assert validate_event(ev) is ev
    held = tokens_event("r1", [0xE2], text="")  # half a character: the ids now, the text later
    assert validate_event(held)["text"] == ""
    tail = tokens_event("r1", [], text="E")  # the held text released at the end
    assert validate_event(tail)["tokens"] == []
    with pytest.raises(AssertionError):
        tokens_event("r1", [], text="")
    with pytest.raises(AssertionError):
        tokens_event("r1", [])


def test_done_event_carries_text():
    ev = done_event("r1", "stop", USAGE, TIMING, tokens=[1], text="a")
    assert ev["text"] == "a" and ev["tokens"] == [1]
    assert validate_event(ev) is ev
    assert "text" not in done_event("r1", "stop", USAGE, TIMING)


@pytest.mark.parametrize("ev", [
    {"v": 1, "ev": "tokens", "id": "a", "tokens": [1], "text": 5},
    {"v": 1, "ev": "tokens", "id": "a", "tokens": [], "text": ""},
    {"v": 1, "ev": "tokens", "id": "a", "tokens": []},
    {"v": 1, "ev": "done", "id": "a", "finish_reason": "stop", "usage": USAGE, "timing": TIMING, "text": ["x"]},
])
def test_event_reader_checks_text(ev):
    with pytest.raises(ProtocolError):
        validate_event(ev)
