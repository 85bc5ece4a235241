"""OpenAI response objects and stream chunks from our `done`/`tokens` events (pure).

The per-token path is bytes templates: a stream's chunk is a prebuilt head,
the orjson-encoded text delta, and a prebuilt tail, so a chunk costs one
small `orjson.dumps` and a join, not a dict per token.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import orjson

# Our finish reasons -> OpenAI's. `cancelled` cannot reach a client that is still listening; vLLM says "abort".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}
DONE = b"data: [DONE]\n\n"

TokenText = Callable[[int], str]  # a token id -> the text shown for it in logprobs


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + os.urandom(12).hex()


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(reason, reason)


def usage(usages: list[dict]) -> dict:
    """OpenAI's usage object, summed over the choices' `done.usage`."""
    p = sum(int(u.get("prompt_tokens", 0)) for u in usages)
    c = sum(int(u.get("completion_tokens", 0)) for u in usages)
    cached = sum(int(u.get("cached_tokens", 0)) for u in usages)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(tokens: list[int], logprobs: list[float], token_text: TokenText,
                        offset: int = 0, tops: list | None = None) -> dict:
    """The legacy completions `logprobs` object (`top_logprobs` null unless alternatives were asked for)."""
    texts = [token_text(t) for t in tokens]
    offsets = []
    for s in texts:
        offsets.append(offset)
        offset += len(s)
    top = None if tops is None else [{token_text(i): v for i, v in t} for t in tops]
    return {"tokens": texts, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokens: list[int], logprobs: list[float], token_text: TokenText, tops: list | None = None) -> dict:
    """The chat `logprobs` object: one entry per chosen token (its alternatives when asked for)."""
    content = []
    for k, (t, lp) in enumerate(zip(tokens, logprobs)):
        s = token_text(t)
        alts = [] if tops is None or k >= len(tops) else \
            [{"token": token_text(i), "logprob": v, "bytes": list(token_text(i).encode())} for i, v in tops[k]]
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": alts})
    return {"content": content}


def completion_object(rid: str, model: str, created: int, choices: list[dict], usages: list[dict]) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(usages)}


def completion_choice(index: int, text: str, reason: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def chat_object(rid: str, model: str, created: int, text: str, reason: str, u: dict,
                logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                         "finish_reason": finish_reason(reason)}],
            "usage": usage([u])}


class ChunkWriter:
    """SSE `data:` lines of one streamed response (completion or chat), built from byte templates."""

    __slots__ = ("kind", "rid", "model", "created", "include_usage", "_heads", "_tail", "_lp_tail", "_top")

    def __init__(self, kind: str, rid: str, model: str, include_usage: bool, created: int | None = None) -> None:
        self.kind = kind
        self.rid = rid
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.include_usage = include_usage
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._top = b'data: {"id":' + orjson.dumps(rid) + b',"object":"' + obj.encode() + b'","created":' \
            + str(self.created).encode() + b',"model":' + orjson.dumps(model) + b',"choices":['
        self._heads: dict[int, bytes] = {}
        u = b',"usage":null' if include_usage else b""
        self._tail = b',"logprobs":null,"finish_reason":null}]' + u + b"}\n\n"
        self._lp_tail = b',"finish_reason":null}]' + u + b"}\n\n"

    def _head(self, index: int) -> bytes:
        h = self._heads.get(index)
        if h is None:
            field = b'"delta":{"content":' if self.kind == "chat" else b'"text":'
            h = self._heads[index] = self._top + b'{"index":' + str(index).encode() + b"," + field
        return h

    def text(self, index: int, delta: str, logprobs: dict | None = None) -> bytes:
        """One chunk carrying a text delta (and, when asked, the delta's logprobs object)."""
        close = b"}" if self.kind == "chat" else b""
        if logprobs is None:
            return self._head(index) + orjson.dumps(delta) + close + self._tail
        return self._head(index) + orjson.dumps(delta) + close + b',"logprobs":' + orjson.dumps(logprobs) \
            + self._lp_tail

    def _chunk(self, choices: list, usage_obj: dict | None = None, with_usage_key: bool = True) -> bytes:
        obj = {"id": self.rid, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage and with_usage_key:
            obj["usage"] = usage_obj
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def role(self, index: int = 0) -> bytes:
        """The first chat chunk: the assistant role, empty content (as OpenAI sends it)."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def finish(self, index: int, reason: str) -> bytes:
        """The chunk that ends a choice: an empty delta and its finish_reason."""
        delta_key = "delta" if self.kind == "chat" else "text"
        delta = {} if self.kind == "chat" else ""
        return self._chunk([{"index": index, delta_key: delta, "logprobs": None,
                             "finish_reason": finish_reason(reason)}])

    def usage(self, usages: list[dict]) -> bytes:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return self._chunk([], usage(usages))


def error_event(err_body: dict) -> bytes:
    """An error after the stream started (the status line is gone): one `data:` event with the error object."""
    return b"data: " + orjson.dumps(err_body) + b"\n\n"
