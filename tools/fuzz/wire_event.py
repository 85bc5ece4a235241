"""Harness: server event bytes -> `ipc.codec.decode_event` (clients, the balancer) and, for `error`
events, the HTTP front's `from_upstream` (the status a client then sees).

Contract: a malformed event is one `ProtocolError` (400, a codec reason; the codec's catch-all
"unreadable event" means the checker itself failed: a finding). An accepted event holds the shapes
docs/protocol.md "Server events" gives, and encode -> decode gives it back unchanged.
"""

from __future__ import annotations

import math

from engine.http.openai_error import OpenAIError, from_upstream
from ipc import codec, schema
from tools.fuzz import json_mutator
from tools.fuzz.codec_contract import check_codec
from tools.fuzz.finding import Finding

MAX_LEN = 4096
_TOKEN_MAX = 2**31 - 1
_TIMING = {"ttft_ms": 1.5, "tpot_ms": None, "e2e_ms": 9.0}
_USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0}

SEEDS = [codec.encode(e) for e in (
    schema.tokens_event("r1", [5]),
    schema.tokens_event("r1", [5, 6], logprobs=[-0.5, -1.25], text="hi"),
    schema.tokens_event("r1", [], text="!"),
    schema.done_event("r1", "length", _USAGE, _TIMING),
    schema.done_event("r1", "stop", _USAGE, _TIMING, tokens=[1, 2], logprobs=[-0.1, -0.2], text="ab"),
    schema.error_event("r1", 429, "queue_full", "the queues are full", retryable=True),
    schema.error_event(None, 400, "bad_json", "not valid JSON"),
    schema.reply_event("r1", "health", {"status": "ok", "chips": 2}),
    schema.reply_event("r1", "models", {"models": [{"alias": "m", "generation": 1}]}),
)]

_NAMES = sorted({"v", "ev", "id", "tokens", "text", "logprobs", "finish_reason", "usage", "timing", "code",
                 "reason", "message", "retryable", "handoff", "step", *schema.EVENTS, *schema.FINISH_REASONS,
                 *schema.USAGE_KEYS, *schema.TIMING_KEYS})


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    return json_mutator.mutate(data, max_size, seed, _NAMES)


def _check(ok: bool, what: str, ev: dict) -> None:
    if not ok:
        raise Finding(f"accepted event of the wrong shape: {what} | {str(ev)[:300]}")


def _ids(v) -> bool:
    return type(v) is list and all(type(t) is int and 0 <= t <= _TOKEN_MAX for t in v)


def _logprobs(ev: dict) -> None:
    lp = ev.get("logprobs")
    _check(lp is None or (type(lp) is list and len(lp) == len(ev["tokens"])
                          and all(type(x) in (int, float) and math.isfinite(x) for x in lp)), "logprobs", ev)


def check_accepted(ev: dict) -> None:
    kind = ev.get("ev")
    _check(ev.get("v") == 1 and type(ev.get("v")) is int and kind in schema.EVENTS, "envelope", ev)
    _check(type(ev.get("id")) is str or (ev.get("id") is None and kind == "error"), "id", ev)
    _check("text" not in ev or kind not in ("tokens", "done") or type(ev["text"]) is str, "text", ev)
    if kind == "tokens":
        _check(_ids(ev.get("tokens")) and (len(ev["tokens"]) > 0 or bool(ev.get("text"))), "tokens", ev)
        _logprobs(ev)
    elif kind == "done":
        _check(ev.get("finish_reason") in ("length", "eos", "stop", "cancelled"), "finish_reason", ev)
        usage, timing = ev.get("usage"), ev.get("timing")
        _check(type(usage) is dict and all(type(usage.get(k)) is int and 0 <= usage[k] < 2**64
                                           for k in ("prompt_tokens", "completion_tokens", "cached_tokens")),
               "usage", ev)
        _check(type(timing) is dict and all(k in timing and (timing[k] is None or (
            type(timing[k]) in (int, float) and math.isfinite(timing[k]) and timing[k] >= 0))
            for k in ("ttft_ms", "tpot_ms", "e2e_ms")), "timing", ev)
        if "tokens" in ev:
            _check(_ids(ev["tokens"]), "tokens", ev)
            _logprobs(ev)
    elif kind == "error":
        _check(type(ev.get("code")) is int and 100 <= ev["code"] <= 599, "code", ev)
        _check(type(ev.get("reason")) is str and type(ev.get("message")) is str, "reason/message", ev)
        _check(type(ev.get("retryable")) is bool, "retryable", ev)
        err = from_upstream(ev)
        _check(isinstance(err, OpenAIError) and 400 <= err.status <= 599 and type(err.message) is str,
               "the front's status for it", ev)
        err.json()


def one_input(data: bytes) -> None:
    check_codec(data, lambda d: codec.decode_event(d, max_bytes=MAX_LEN), schema.validate_event, "event",
                check_accepted)