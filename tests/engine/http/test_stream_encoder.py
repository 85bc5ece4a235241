"""One streamed response's writes (engine.http.stream_encoder): a batch of upstream events -> one write."""

from __future__ import annotations

import orjson
import pytest

from engine.http.openai_error import OpenAIError
from engine.http.openai_response import ChunkWriter
from engine.http.stream_encoder import StreamEncoder


def events(data: bytes) -> list[dict]:
    assert data.endswith(b"\n\n")
    return [orjson.loads(block[len(b"data: "):]) for block in data[:-2].split(b"\n\n")]


def tokens(toks: list[int], text: str | None, logprobs: list[float] | None = None) -> dict:
    ev = {"ev": "tokens", "id": "r", "tokens": toks}
    if text is not None:
        ev["text"] = text
    if logprobs is not None:
        ev["logprobs"] = logprobs
    return ev


def done(reason: str = "length", completion_tokens: int = 3) -> dict:
    return {"ev": "done", "id": "r", "finish_reason": reason,
            "usage": {"prompt_tokens": 2, "completion_tokens": completion_tokens}}


def encoder(kind: str = "completion", choices: int = 1, logprobs: bool = False, usage: bool = False):
    return StreamEncoder(ChunkWriter(kind, "id-1", "m", usage, created=1), choices, logprobs=logprobs,
                         token_text=lambda t: f"<{t}>")


def test_one_batch_is_one_chunk_with_the_texts_joined():
    enc = encoder()
    out = events(enc.encode(0, [tokens([1], "a"), tokens([2], "b"), tokens([3], "c")]))
    assert [e["choices"][0]["text"] for e in out] == ["abc"]
    assert enc.started and enc.left == 1


def test_tokens_whose_text_is_held_back_still_leave_as_an_empty_delta():
    """The first byte of a two-byte character: the token arrived, its text not yet; the client still hears of it
    now (its TTFT), and the character comes whole with the next token."""
    enc = encoder()
    first = events(enc.encode(0, [tokens([0xC3], "")]))
    assert first == [{"id": "id-1", "object": "text_completion", "created": 1, "model": "m",
                      "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]}]
    assert enc.started
    assert [e["choices"][0]["text"] for e in events(enc.encode(0, [tokens([0xA9], "\u00e9")]))] == ["\u00e9"]


def test_a_chat_stream_starts_with_the_role_then_an_empty_content_delta():
    enc = encoder("chat")
    out = events(enc.head() + enc.encode(0, [tokens([0xC3], "")]))
    assert [e["choices"][0]["delta"] for e in out] == [{"role": "assistant", "content": ""}, {"content": ""}]


def test_a_batch_without_tokens_writes_nothing():
    enc = encoder()
    assert enc.encode(0, [tokens([], "")]) == b""
    assert not enc.started


def test_a_last_batch_with_held_back_text_needs_no_empty_delta():
    enc = encoder(usage=True)
    out = events(enc.encode(0, [tokens([0xC3], ""), done()]))
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in out] == [("", "length")]
    assert enc.left == 0
    tail = events(enc.tail())
    assert tail[0]["usage"]["completion_tokens"] == 3 and tail[0]["choices"] == []


def test_logprobs_of_the_batch_ride_on_its_chunk():
    enc = encoder(logprobs=True)
    out = events(enc.encode(0, [tokens([7], "x", [-0.5]), tokens([8], "", [-1.0])]))
    assert out[0]["choices"][0]["text"] == "x"
    assert out[0]["choices"][0]["logprobs"]["tokens"] == ["<7>", "<8>"]
    assert out[0]["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -1.0]


def test_choices_end_separately_and_the_usage_sums_them():
    enc = encoder(choices=2, usage=True)
    enc.encode(1, [tokens([1], "a"), done(completion_tokens=1)])
    assert enc.left == 1
    enc.encode(0, [tokens([2], "b"), done("eos", completion_tokens=2)])
    assert enc.left == 0
    assert events(enc.tail())[0]["usage"]["completion_tokens"] == 3


def test_an_upstream_error_raises_its_openai_error():
    enc = encoder()
    with pytest.raises(OpenAIError) as e:
        enc.encode(0, [tokens([1], "a"), {"ev": "error", "id": "r", "code": 504, "reason": "deadline",
                                          "message": "deadline passed", "retryable": False}])
    assert e.value.status == 504
