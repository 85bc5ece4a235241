"""Harness: an HTTP body -> the front's parsing (`engine.http.openai_request`, `response_format`,
`kv_transfer`) -> the wire `generate` messages `Front.prepare` builds from it.

Contract (docs/http.md "Errors"; engine/http/app.py): the front turns an `OpenAIError` into its status
and anything else into a 500. So a body is either refused with an `OpenAIError` of status 4xx, or
accepted; any other exception is a 500 and a finding. An accepted body becomes wire requests that
`ipc.schema.validate_request` accepts: the front checks each field it maps with the wire's ranges, so
its client gets the 400 naming the field, not a protocol error from upstream.
"""

from __future__ import annotations

import orjson

from engine.http.app import Front
from engine.http.metrics import HttpMetrics
from engine.http.openai_error import OpenAIError
from engine.http.openai_request import CHAT_FIELDS, COMPLETION_FIELDS, ROLES, parse_chat, parse_completion
from ipc import schema
from ipc.codec import ProtocolError
from tools.fuzz import json_mutator
from tools.fuzz.finding import Finding


class _Client:
    def new_id(self) -> str:
        return "fuzz-1"


class _Upstream:
    """An upstream that has not said what it serves: `prepare` then maps the body alone."""

    models: list = []
    client = _Client()

    def model_for(self, name):
        return None

    def require_up(self):
        return self.client


_FRONT = Front(_Upstream(), metrics=HttpMetrics())

SEEDS = [orjson.dumps(b) for b in (
    {"model": "m", "prompt": "Hello", "max_tokens": 8},
    {"prompt": ["a", "b"], "temperature": 0.5, "top_p": 0.9, "top_k": -1, "seed": -3, "stop": ["\n"],
     "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0, "user": "alice@example.com",
     "n": 1, "echo": False, "presence_penalty": 0, "priority": 3, "stop_token_ids": [2], "ignore_eos": True},
    {"prompt": [1, 2, 3], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                                       "schema": {"type": "object"}}}},
    {"prompt": [[1], [2, 3]], "guided_choice": ["yes", "no"], "speculative": "ngram"},
    {"prompt": "x", "guided_regex": "[0-9]+", "kv_transfer_params": {"do_remote_decode": True}, "min_tokens": 1,
     "max_tokens": 1},
    {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e1",
                                           "remote_request_id": "r1", "npuserve_handoff": {
                                               "board": "b", "request": "r", "prompt_len": 3, "blocks": [1],
                                               "endpoint": "tcp://127.0.0.1:9", "first_token": 4}}},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
     "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 0, "add_generation_prompt": True,
     "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}, {"role": "assistant",
                                                                               "content": None}],
     "response_format": {"type": "json_object"}, "tools": [], "tool_choice": "none", "grammar": "root ::= \"a\""},
    {"messages": [{"role": "user", "content": "q", "name": "n"}], "guided_json": "{\"type\": \"string\"}",
     "json_schema": None, "stream": False, "seed": 18446744073709551615},
)]

_NAMES = sorted(COMPLETION_FIELDS | CHAT_FIELDS | set(ROLES) | {
    "role", "content", "type", "text", "json_schema", "schema", "strict", "name", "include_usage",
    "continuous_usage_stats", "do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_request_id",
    "remote_host", "remote_port", "npuserve_handoff", "board", "request", "prompt_len", "blocks", "layout",
    "endpoint", "curve_key", "host_pool", "first_token", "slots", "slot_bytes", "host"})


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    return json_mutator.mutate(data, max_size, seed, _NAMES)


def _wire(req, body: dict) -> None:
    """The wire requests the front would send must pass the wire's own checks."""
    if req.kind == "chat":  # the chat template needs a served model: map the rest as a completion would
        req.kind, req.prompts = "completion", [[1]]
        if req.sampling.get("max_tokens") is None:
            req.sampling["max_tokens"] = 16
    prep = _FRONT.prepare(req, None)
    for msg in prep.msgs:
        try:
            schema.validate_request(msg)
        except ProtocolError as e:
            raise Finding(f"the front accepts what the wire refuses: {e.reason} {e.message.split(':')[0]} | "
                          f"{e}; body {str(body)[:300]}") from None


def one_input(data: bytes) -> None:
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return  # the front's 400 invalid_json
    for parse in (parse_completion, parse_chat):
        try:
            req = parse(body, 1.0)
            _check_request(req)
            _wire(req, body)
        except OpenAIError as e:
            if not 400 <= e.status <= 499:
                raise Finding(f"{parse.__name__} refused with status {e.status} | {e.message[:200]}") from None
            e.json()


def _check_request(req) -> None:
    if type(req.stream) is not bool or type(req.include_usage) is not bool or type(req.logprobs) is not bool:
        raise Finding(f"flags are not bools | {req}")
    if req.kind == "completion" and not (req.prompts and all(
            type(p) is str or (type(p) is list and p) for p in req.prompts)):
        raise Finding(f"accepted a completion without a usable prompt | {req.prompts!r:.200}")
    if req.kind == "chat" and not (req.messages and all(
            m["role"] in ROLES and type(m["content"]) is str for m in req.messages)):
        raise Finding(f"accepted chat messages the template cannot take | {req.messages!r:.200}")
