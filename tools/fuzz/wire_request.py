"""Harness: client request bytes -> `ipc.codec.decode_request` (the daemon's and balancer's front door).

Contract (docs/protocol.md "Errors"): a malformed message is one `ProtocolError` (code 400, a codec
reason); anything else escaping, or the codec's catch-all for a validation bug ("unreadable request"),
is a finding. An accepted request must hold the documented ranges (checked here against the numbers of
docs/protocol.md, not against the schema's own constants) and survive encode -> decode unchanged.
"""

from __future__ import annotations

import math
import re
from typing import Any

import orjson

from ipc import codec, schema
from tools.fuzz import json_mutator
from tools.fuzz.codec_contract import check_codec
from tools.fuzz.finding import Finding

MAX_LEN = 4096

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}\Z")
_TOKEN_MAX = 2**31 - 1
_Z85 = set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def _seed(**fields: Any) -> bytes:
    return orjson.dumps({"v": 1, "id": "r1", **fields})


SEEDS = [
    _seed(op="generate", prompt=[1, 2, 3], max_tokens=8),
    _seed(op="generate", text="Hello", max_tokens=4, temperature=0.7, top_p=0.9, top_k=40, seed=7,
          stop=["\n", [13, 10]], stop_token_ids=[2], tenant="alice", priority=5, logprobs=True, stream=False,
          deadline_ms=1000, model="tiny", pool="fast", speculative="ngram", ignore_eos=True, continuation=[4]),
    _seed(op="generate", prompt=[1], constraint={"kind": "json_schema", "body": {"type": "object"}}),
    _seed(op="generate", prompt=[1], constraint={"kind": "regex", "body": "[a-z]+"}),
    _seed(op="generate", prompt=[1], handoff={"export": True}),
    _seed(op="generate", prompt=[1], handoff={"board": "b1", "request": "h1", "prompt_len": 3, "blocks": [0, 1],
                                              "first_token": 5, "endpoint": "tcp://127.0.0.1:5555",
                                              "curve_key": "x" * 40, "layout": {"block": 16, "dtype": "f16"},
                                              "host_pool": {"name": "/p", "slots": 4, "slot_bytes": 64,
                                                            "layout": "0123456789abcdef", "host": "h"}}),
    _seed(op="cancel"), _seed(op="health"), _seed(op="stats"), _seed(op="models", auth="tok"),
    _seed(op="load", alias="m", package="pkgs/m"), _seed(op="unload", alias="m", deadline_s=1.5),
    _seed(op="replace", alias="m", package="pkgs/m2", deadline_s=None, auth=None),
    _seed(op="rollback", alias="m"), _seed(op="drain", timeout_ms=100, backend="tcp://127.0.0.1:1"),
    _seed(op="resume"), _seed(op="reenable_inflight", chip=1),
    _seed(op="generate", prompt=[1], adapter="sql"), _seed(op="load_lora", alias="sql", package="loras/sql", base="m"),
    _seed(op="unload_lora", alias="sql"),
]

_NAMES = sorted({f for fields in schema.OP_FIELDS.values() for f in fields} | {"v", "op", "id", "kind", "body",
                 "export", "board", "request", "prompt_len", "blocks", "layout", "first_token", "endpoint",
                 "curve_key", "host_pool", "name", "slots", "slot_bytes", "host"} | set(schema.REQUEST_OPS))


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    return json_mutator.mutate(data, max_size, seed, _NAMES)


def _check(ok: bool, what: str, req: dict) -> None:
    if not ok:
        raise Finding(f"accepted out of range: {what} | {str(req)[:300]}")


def _is_int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _is_num(v: Any, lo: float, hi: float, lo_open: bool = False) -> bool:
    return type(v) is float and math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi


def _is_ids(v: Any, lo_len: int, hi_len: int) -> bool:
    return type(v) is list and lo_len <= len(v) <= hi_len and all(_is_int(t, 0, _TOKEN_MAX) for t in v)


def _is_text(v: Any, lo: int, hi: int) -> bool:
    return type(v) is str and lo <= len(v) <= hi


def _is_name(v: Any) -> bool:
    return type(v) is str and _NAME.match(v) is not None


def check_generate(r: dict) -> None:
    _check(("prompt" in r) != ("text" in r), "exactly one of prompt and text", r)
    if "prompt" in r:
        _check(_is_ids(r["prompt"], 1, 1 << 20), "prompt", r)
    if "text" in r:
        _check(_is_text(r["text"], 0, 1 << 20), "text", r)
    _check(r["model"] is None or _is_name(r["model"]), "model", r)
    _check(r.get("adapter") is None or _is_name(r["adapter"]), "adapter", r)
    _check(_is_int(r["max_tokens"], 1, 1 << 20), "max_tokens", r)
    _check(_is_num(r["temperature"], 0.0, 100.0), "temperature", r)
    _check(_is_num(r["top_p"], 0.0, 1.0, lo_open=True), "top_p", r)
    _check(_is_int(r["top_k"], 0, _TOKEN_MAX), "top_k", r)
    _check(_is_int(r["seed"], 0, 2**64 - 1), "seed", r)
    _check(_is_ids(r["stop_token_ids"], 0, 256), "stop_token_ids", r)
    stop = r["stop"]
    _check(type(stop) is list and len(stop) <= 16 and all(
        _is_text(s, 1, 256) if type(s) is str else _is_ids(s, 1, 64) for s in stop), "stop", r)
    _check(type(r["ignore_eos"]) is bool and type(r["logprobs"]) is bool and type(r["stream"]) is bool, "bools", r)
    _check(r["deadline_ms"] is None or _is_int(r["deadline_ms"], 1, 86_400_000), "deadline_ms", r)
    _check(_is_name(r["tenant"]), "tenant", r)
    _check(_is_int(r["priority"], -100, 100), "priority", r)
    _check(_is_ids(r["continuation"], 0, 1 << 20), "continuation", r)
    _check(r["pool"] is None or _is_name(r["pool"]), "pool", r)
    _check(r["speculative"] in (None, "off", "ngram", "draft"), "speculative", r)
    c = r.get("constraint")
    if c is not None:
        _check(type(c) is dict and set(c) == {"kind", "body"} and c["kind"] in schema.CONSTRAINT_KINDS
               and (type(c["body"]) is str or (c["kind"] == "json_schema" and type(c["body"]) in (dict, bool))),
               "constraint", r)
        _check(c["kind"] == "json_object" or c["body"] not in ("", None), "constraint.body", r)
    h = r.get("handoff")
    if h is not None:
        _check(type(h) is dict, "handoff", r)
        if h.get("export"):
            _check(h == {"export": True}, "handoff export leg", r)
        else:
            _check(_is_text(h.get("board"), 1, 128) and _is_text(h.get("request"), 1, 128), "handoff names", r)
            _check(_is_int(h.get("prompt_len"), 0, 1 << 20) and _is_ids(h.get("blocks"), 0, 1 << 16),
                   "handoff prompt_len/blocks", r)
            if "endpoint" in h:
                _check(_is_text(h["endpoint"], 6, 256) and h["endpoint"].startswith(("tcp://", "ipc://")),
                       "handoff endpoint", r)
            if "curve_key" in h:
                _check(_is_text(h["curve_key"], 40, 40) and set(h["curve_key"]) <= _Z85, "handoff curve_key", r)
            if "first_token" in h:
                _check(_is_int(h["first_token"], 0, _TOKEN_MAX), "handoff first_token", r)
            if "layout" in h:
                _check(type(h["layout"]) is dict and len(h["layout"]) <= 16, "handoff layout", r)


def check_admin(r: dict) -> None:
    op = r["op"]
    if op in schema.ADMIN_OPS:
        _check(r["auth"] is None or _is_text(r["auth"], 1, 256), "auth", r)
    if op in ("load", "unload", "replace", "rollback", "load_lora", "unload_lora"):
        _check(_is_name(r["alias"]), "alias", r)
    if op == "load_lora":
        _check(r["base"] is None or _is_name(r["base"]), "base", r)
    if op in ("load", "replace", "load_lora"):
        _check(_is_text(r["package"], 1, 4096), "package", r)
    if op in ("unload", "replace", "rollback"):
        _check(r["deadline_s"] is None or _is_num(r["deadline_s"], 0.0, 86_400.0), "deadline_s", r)
    if op == "drain":
        _check(r["timeout_ms"] is None or _is_int(r["timeout_ms"], 0, 86_400_000), "timeout_ms", r)
    if op in ("drain", "resume"):
        _check(r["backend"] is None or _is_text(r["backend"], 1, 4096), "backend", r)
    if op == "reenable_inflight":
        _check(r["chip"] is None or _is_int(r["chip"], 0, 1023), "chip", r)


def check_accepted(r: dict) -> None:
    _check(r.get("v") == 1 and r.get("op") in schema.REQUEST_OPS and _is_text(r.get("id"), 1, 128), "envelope", r)
    allowed = set(schema.OP_FIELDS[r["op"]]) | {"v", "op", "id"}
    _check(set(r) <= allowed, "fields of the op", r)
    if r["op"] == "generate":
        check_generate(r)
    else:
        check_admin(r)


def one_input(data: bytes) -> None:
    check_codec(data, lambda d: codec.decode_request(d, max_bytes=MAX_LEN), schema.validate_request, "request", check_accepted)