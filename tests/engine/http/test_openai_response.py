"""Response objects and SSE chunks (engine.http.openai_response): the byte templates equal plain JSON."""

from __future__ import annotations

import orjson
import pytest

from engine.http.openai_error import OpenAIError, from_upstream
from engine.http.openai_response import (
    DONE, ChunkWriter, chat_logprobs, completion_choice, completion_logprobs, finish_reason, usage,
)


def event(data: bytes) -> dict:
    assert data.startswith(b"data: ") and data.endswith(b"\n\n") and data.count(b"\n\n") == 1
    return orjson.loads(data[len(b"data: "):])


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_text_chunk_is_the_openai_chunk(include_usage):
    w = ChunkWriter("completion", "cmpl-1", "m", include_usage, created=5)
    expected = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
                "choices": [{"index": 2, "text": "a\"\u00e9\n", "logprobs": None, "finish_reason": None}]}
    if include_usage:
        expected["usage"] = None
    assert event(w.text(2, "a\"\u00e9\n")) == expected


def test_chat_chunks_role_text_logprobs_finish_usage():
    w = ChunkWriter("chat", "chatcmpl-1", "m", True, created=5)
    top = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    assert event(w.role()) == {**top, "usage": None, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    lp = {"content": [{"token": "x", "logprob": -1.0, "bytes": [120], "top_logprobs": []}]}
    assert event(w.text(0, "x", lp)) == {**top, "usage": None, "choices": [
        {"index": 0, "delta": {"content": "x"}, "logprobs": lp, "finish_reason": None}]}
    assert event(w.finish(0, "eos")) == {**top, "usage": None, "choices": [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}
    u = event(w.usage([{"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1}]))
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                                 "prompt_tokens_details": {"cached_tokens": 1}}
    assert DONE == b"data: [DONE]\n\n"


@pytest.mark.parametrize("ours,theirs", [("eos", "stop"), ("stop", "stop"), ("length", "length"),
                                         ("cancelled", "abort")])
def test_finish_reasons(ours, theirs):
    assert finish_reason(ours) == theirs
    assert completion_choice(0, "t", ours)["finish_reason"] == theirs


def test_usage_sums_choices():
    assert usage([{"prompt_tokens": 2, "completion_tokens": 3}, {"prompt_tokens": 1, "completion_tokens": 1}]) == \
        {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}


def test_logprobs_objects():
    text = {1: "a", 2: "bc"}.__getitem__
    assert completion_logprobs([1, 2], [-0.5, -1.5], text) == {
        "tokens": ["a", "bc"], "token_logprobs": [-0.5, -1.5], "top_logprobs": None, "text_offset": [0, 1]}
    assert chat_logprobs([2], [-1.5], text)["content"] == [{"token": "bc", "logprob": -1.5, "bytes": [98, 99],
                                                            "top_logprobs": []}]


@pytest.mark.parametrize("code,typ", [(400, "invalid_request_error"), (401, "authentication_error"),
                                      (404, "not_found_error"), (429, "rate_limit_error"),
                                      (503, "service_unavailable_error"), (504, "timeout_error"),
                                      (500, "server_error")])
def test_upstream_errors_keep_their_status(code, typ):
    e = from_upstream({"ev": "error", "code": code, "reason": "why", "message": "max_tokens: too big"})
    assert (e.status, e.type, e.code) == (code, typ, "why")
    assert e.body() == {"error": {"message": "max_tokens: too big", "type": typ,
                                  "param": "max_tokens" if code == 400 else None, "code": "why"}}


def test_an_error_is_json():
    assert orjson.loads(OpenAIError(429, "busy").json())["error"]["type"] == "rate_limit_error"
