"""The wire schema (docs/protocol.md): what each request op may carry, and the server events.

Validation lives here, apart from byte parsing (`ipc.codec`), so that a
balancer or test can validate an already-parsed object. Every violation is one
`ProtocolError` with an HTTP-like code and a machine-readable `reason`; the
daemon turns it into an `error` event and keeps serving.

Requests are strict: an unknown field is an error (the protocol is versioned,
so a typo such as `max_token` must not silently fall back to a default).
Events are read leniently: a client ignores event fields it does not know, so
a server may add fields without a version bump.

Range checks here are the ones that hold for every model (a token id fits an
int32, a temperature is finite); vocabulary and context length are checked by
the scheduler, which knows the model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from ipc import sampling_fields
from ipc.logprob_wants import MAX_TOP

PROTOCOL_VERSION = 1

REQUEST_OPS = ("generate", "cancel", "health", "stats", "load", "unload", "replace", "rollback",
               "models", "drain", "resume", "reenable_inflight", "hello", "load_lora", "unload_lora")
ADMIN_OPS = ("load", "unload", "replace", "rollback", "models", "drain", "resume", "reenable_inflight",
             "load_lora", "unload_lora")
# One reply event per non-generate op, named like the op; `cancel` has none
# (the cancelled stream's own terminal event is the acknowledgement).
REPLY_EVENTS = ("health", "stats", "models", "load", "unload", "replace", "rollback", "drain", "resume",
                "reenable_inflight", "hello", "load_lora", "unload_lora")
STREAM_EVENTS = ("tokens", "done", "error")
EVENTS = STREAM_EVENTS + REPLY_EVENTS
FINISH_REASONS = ("length", "eos", "stop", "cancelled")
# What a connection may ask for with `hello`. Without it, every server message is exactly one event (one JSON
# frame), which every v1 client understands; `batched_events` lets the server send several events as the frames of
# one message (one send per connection per loop turn instead of one per stream).
BATCHED_EVENTS = "batched_events"
CAPABILITIES = (BATCHED_EVENTS,)
MAX_CAPABILITIES = 16
ERROR_CODES = (400, 401, 403, 404, 409, 429, 500, 501, 503, 504)

# Request-independent bounds. Token ids travel as int32 in the job records.
TOKEN_ID_MAX = (1 << 31) - 1
UINT64_MAX = (1 << 64) - 1
MAX_ID_CHARS = 128
MAX_PROMPT_TOKENS = 1 << 20
MAX_NEW_TOKENS = 1 << 20
DEFAULT_MAX_TOKENS = 16
MAX_TEMPERATURE = 100.0
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_TOKENS = 64
MAX_STOP_STRING_CHARS = 256
MAX_TEXT_CHARS = 1 << 20  # the message size limit (server.max_message_bytes) usually binds first
MAX_DEADLINE_MS = 86_400_000
MAX_RETRY_AFTER_MS = 86_400_000  # an error event's retry_after_ms (servers clamp far lower: engine/core/retry_after.py)
PRIORITY_MIN, PRIORITY_MAX = -100, 100
MAX_AUTH_CHARS = 256
MAX_PATH_CHARS = 4096
# Model aliases and tenant names reach file names, logs and metric labels.
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}\Z")
REASON_RE = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")
Z85_KEY_RE = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}\Z")  # a CURVE public key, z85-encoded

# Reasons the codec produces (all with code 400).
CODEC_REASONS = ("bad_json", "not_an_object", "too_large", "bad_version", "unknown_op", "unknown_field",
                 "missing_field", "conflicting_fields", "bad_type", "out_of_range")


class ProtocolError(Exception):
    """One malformed message: what to tell the sender, and the request id when it could be read."""

    def __init__(self, reason: str, message: str, id: str | None = None, code: int = 400) -> None:
        super().__init__(message)
        assert REASON_RE.match(reason), reason
        self.code = code
        self.reason = reason
        self.message = message
        self.id = id

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def to_event(self) -> dict:
        return error_event(self.id, self.code, self.reason, self.message, retryable=False)


class _FieldError(Exception):
    """Raised by field checkers; `validate_request` adds the request id."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


_REQUIRED = object()
_ABSENT = object()  # optional field without a default: absent from the validated request when not sent
Checker = Callable[[str, Any], Any]


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int(lo: int, hi: int) -> Checker:
    def check(name: str, value: Any) -> int:
        if type(value) is not int:  # bool is an int subclass: rejected on purpose
            raise _FieldError("bad_type", f"{name}: must be an int, got {_type_name(value)}")
        if not lo <= value <= hi:
            raise _FieldError("out_of_range", f"{name}: must be in [{lo}, {hi}], got {value}")
        return value
    return check


def _float(lo: float, hi: float, lo_open: bool = False) -> Checker:
    def check(name: str, value: Any) -> float:
        if type(value) not in (int, float):
            raise _FieldError("bad_type", f"{name}: must be a number, got {_type_name(value)}")
        x = float(value)
        below = x <= lo if lo_open else x < lo
        if not math.isfinite(x) or below or x > hi:
            bracket = "(" if lo_open else "["
            raise _FieldError("out_of_range", f"{name}: must be a finite number in {bracket}{lo}, {hi}], got {value}")
        return x
    return check


def _bool(name: str, value: Any) -> bool:
    if type(value) is not bool:
        raise _FieldError("bad_type", f"{name}: must be true or false, got {_type_name(value)}")
    return value


def _name(name: str, value: Any) -> str:
    if type(value) is not str:
        raise _FieldError("bad_type", f"{name}: must be a string, got {_type_name(value)}")
    if not NAME_RE.match(value):
        raise _FieldError("out_of_range", f"{name}: must be 1-64 characters of [A-Za-z0-9_.:-], "
                                          f"not starting with [.:-], got {value[:80]!r}")
    return value


SPECULATIVE_METHODS = ("off", "ngram", "draft")  # a request's `speculative` ("draft": the board's draft model)


def _capabilities(name: str, value: Any) -> list[str]:
    """Names of capabilities a client asks for; names this server does not know pass (and are not granted),
    so a client can ask a newer server's capability of an older one."""
    if type(value) is not list:
        raise _FieldError("bad_type", f"{name}: must be a list of names, got {_type_name(value)}")
    if len(value) > MAX_CAPABILITIES:
        raise _FieldError("out_of_range", f"{name}: at most {MAX_CAPABILITIES} entries, got {len(value)}")
    for i, v in enumerate(value):
        if type(v) is not str:
            raise _FieldError("bad_type", f"{name}[{i}]: must be a string, got {_type_name(v)}")
        if not REASON_RE.match(v):
            raise _FieldError("out_of_range", f"{name}[{i}]: must be a snake_case name of 1-64 characters, got {v[:80]!r}")
    return list(value)


def _choice(options: tuple[str, ...]) -> Checker:
    def check(name: str, value: Any) -> str:
        if value not in options or type(value) is not str:
            raise _FieldError("out_of_range", f"{name}: must be one of {', '.join(options)}, got {value!r}")
        return value
    return check


def _text(min_chars: int, max_chars: int) -> Checker:
    def check(name: str, value: Any) -> str:
        if type(value) is not str:
            raise _FieldError("bad_type", f"{name}: must be a string, got {_type_name(value)}")
        if not min_chars <= len(value) <= max_chars:
            raise _FieldError("out_of_range", f"{name}: must be {min_chars}-{max_chars} characters, got {len(value)}")
        return value
    return check


def _tokens(min_len: int, max_len: int) -> Checker:
    one_ok = min_len <= 1 <= max_len

    def check(name: str, value: Any) -> list[int]:
        if one_ok and type(value) is list and len(value) == 1:  # a streamed event's usual one token
            t = value[0]
            if type(t) is int and 0 <= t <= TOKEN_ID_MAX:
                return value
        if type(value) is not list:
            raise _FieldError("bad_type", f"{name}: must be a list of token ids, got {_type_name(value)}")
        if not min_len <= len(value) <= max_len:
            what = "a non-empty list" if min_len == 1 and len(value) == 0 else f"{min_len}-{max_len} tokens"
            raise _FieldError("out_of_range", f"{name}: must be {what}, got {len(value)}")
        if set(map(type, value)) - {int}:  # exact type: a bool is not a token id
            bad = next(t for t in value if type(t) is not int)
            raise _FieldError("bad_type", f"{name}: token ids must be ints, got {_type_name(bad)}")
        if value and (min(value) < 0 or max(value) > TOKEN_ID_MAX):
            bad = next(t for t in value if not 0 <= t <= TOKEN_ID_MAX)
            raise _FieldError("out_of_range", f"{name}: token ids must be in [0, {TOKEN_ID_MAX}], got {bad}")
        return value
    return check


_stop_sequence = _tokens(1, MAX_STOP_SEQUENCE_TOKENS)
_stop_string = _text(1, MAX_STOP_STRING_CHARS)


def _stop(name: str, value: Any) -> list[list[int] | str]:
    """Stop sequences: token-id lists (matched on ids) and strings (matched on the output text), mixed."""
    if type(value) is not list:
        raise _FieldError("bad_type", f"{name}: must be a list of strings and token-id lists, "
                                      f"got {_type_name(value)}")
    if len(value) > MAX_STOP_SEQUENCES:
        raise _FieldError("out_of_range", f"{name}: at most {MAX_STOP_SEQUENCES} stop sequences, got {len(value)}")
    out: list[list[int] | str] = []
    for i, seq in enumerate(value):
        if type(seq) is str:
            out.append(_stop_string(f"{name}[{i}]", seq))
        elif type(seq) is list:
            out.append(_stop_sequence(f"{name}[{i}]", seq))
        else:
            raise _FieldError("bad_type", f"{name}[{i}]: must be a string or a list of token ids, "
                                          f"got {_type_name(seq)}")
    return out


# Structured output: what a `constraint` may be (the daemon compiles the body; see docs/protocol.md).
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")
MAX_CONSTRAINT_CHARS = 1 << 16  # compiled on the daemon's loop: ~1 s for a 100 KB schema (loaded 2 cores)


def _constraint(name: str, value: Any) -> dict:
    """{"kind": one of CONSTRAINT_KINDS, "body": a string (a JSON schema may also be an object)}.

    Only the shape is checked here; whether the body compiles is the daemon's
    question (a 400 `invalid_constraint` naming the problem)."""
    if type(value) is not dict:
        raise _FieldError("bad_type", f"{name}: must be an object with kind and body, got {_type_name(value)}")
    extra = sorted(set(value) - {"kind", "body"})
    if extra:
        raise _FieldError("unknown_field", f"{name}.{extra[0][:64]}: unknown field (kind, body)")
    kind = value.get("kind")
    if kind not in CONSTRAINT_KINDS:
        raise _FieldError("out_of_range", f"{name}.kind: must be one of {', '.join(CONSTRAINT_KINDS)}, "
                                          f"got {str(kind)[:64]!r}")
    body = value.get("body", "" if kind == "json_object" else None)
    if kind == "json_schema" and type(body) in (dict, bool):
        size = len(orjson.dumps(body))
        if size > MAX_CONSTRAINT_CHARS:
            raise _FieldError("out_of_range", f"{name}.body: at most {MAX_CONSTRAINT_CHARS} characters of JSON, "
                                              f"got {size}")
        return {"kind": kind, "body": body}
    if type(body) is not str:
        raise _FieldError("bad_type", f"{name}.body: must be a string for kind {kind!r}, got {_type_name(body)}")
    if len(body) > MAX_CONSTRAINT_CHARS:
        raise _FieldError("out_of_range", f"{name}.body: at most {MAX_CONSTRAINT_CHARS} characters, got {len(body)}")
    if kind != "json_object" and not body:
        raise _FieldError("out_of_range", f"{name}.body: must not be empty for kind {kind!r}")
    return {"kind": kind, "body": body}


def _logit_bias(name: str, value: Any) -> dict[str, float]:
    return sampling_fields.logit_bias(name, value, _FieldError, TOKEN_ID_MAX)


def _nullable(check: Checker) -> Checker:
    def nullable(name: str, value: Any) -> Any:
        return None if value is None else check(name, value)
    return nullable


MAX_HANDOFF_BLOCKS = 1 << 16
MAX_LAYOUT_KEYS = 16
_HANDOFF_KEYS = ("export", "board", "request", "prompt_len", "blocks", "layout", "first_token", "endpoint",
                 "curve_key", "host_pool")
_HOST_POOL_KEYS = ("name", "slots", "slot_bytes", "layout", "host")
MAX_HANDOFF_ENDPOINT_CHARS = 256
_handoff_name = _text(1, MAX_ID_CHARS)


def _host_pool(name: str, value: Any) -> dict:
    """The exporter's host KV slot pool: segment name, slots, slot size, layout tag, host id."""
    if type(value) is not dict or sorted(value) != sorted(_HOST_POOL_KEYS):
        raise _FieldError("bad_type", f"{name}: must be an object of {', '.join(_HOST_POOL_KEYS)}")
    return {"name": _text(1, 255)(f"{name}.name", value["name"]),
            "slots": _int(1, 1 << 31)(f"{name}.slots", value["slots"]),
            "slot_bytes": _int(1, 1 << 40)(f"{name}.slot_bytes", value["slot_bytes"]),
            "layout": _text(1, 64)(f"{name}.layout", value["layout"]),
            "host": _text(1, MAX_HANDOFF_ENDPOINT_CHARS)(f"{name}.host", value["host"])}


def _handoff(name: str, value: Any) -> dict:
    """Prefill/decode hand-off (docs/protocol.md#handoff): `{"export": true}` on a prefill leg, or the
    descriptor of where the prompt's KV is held (board, request, prompt_len, blocks, layout, first_token)
    on a decode leg. A decode board that cannot use the descriptor recomputes the prompt."""
    if type(value) is not dict:
        raise _FieldError("bad_type", f"{name}: must be an object, got {_type_name(value)}")
    unknown = sorted(k for k in value if k not in _HANDOFF_KEYS)
    if unknown:
        raise _FieldError("unknown_field", f"{name}.{unknown[0][:64]}: unknown field")
    out: dict[str, Any] = {}
    if "export" in value:
        out["export"] = _bool(f"{name}.export", value["export"])
    if out.get("export") and len(value) > 1:
        raise _FieldError("conflicting_fields", f"{name}: an export leg carries only export")
    if not out.get("export"):
        for k in ("board", "request"):
            if k not in value:
                raise _FieldError("missing_field", f"{name}.{k}: required in a hand-off descriptor")
            out[k] = _handoff_name(f"{name}.{k}", value[k])
        out["prompt_len"] = _int(0, MAX_PROMPT_TOKENS)(f"{name}.prompt_len", value.get("prompt_len", 0))
        out["blocks"] = _tokens(0, MAX_HANDOFF_BLOCKS)(f"{name}.blocks", value.get("blocks", []))
        if value.get("first_token") is not None:
            out["first_token"] = _int(0, TOKEN_ID_MAX)(f"{name}.first_token", value["first_token"])
        if value.get("endpoint") is not None:  # the exporter's KV transfer endpoint (a zmq address)
            out["endpoint"] = _text(1, MAX_HANDOFF_ENDPOINT_CHARS)(f"{name}.endpoint", value["endpoint"])
            if not out["endpoint"].startswith(("tcp://", "ipc://")):
                raise _FieldError("out_of_range", f"{name}.endpoint: must be a tcp:// or ipc:// endpoint")
        if value.get("curve_key") is not None:  # its CURVE public key (z85, 40 characters)
            out["curve_key"] = _text(40, 40)(f"{name}.curve_key", value["curve_key"])
            if not Z85_KEY_RE.match(out["curve_key"]):  # zmq refuses any other key when the pull connects
                raise _FieldError("out_of_range", f"{name}.curve_key: must be a z85-encoded key (40 characters "
                                                  f"of the z85 alphabet)")
        if value.get("host_pool") is not None:  # its host KV slot pool (shared memory, one host)
            out["host_pool"] = _host_pool(f"{name}.host_pool", value["host_pool"])
        layout = value.get("layout")
        if layout is not None:
            if type(layout) is not dict or len(layout) > MAX_LAYOUT_KEYS or not all(
                    type(k) is str and len(k) <= 64 and (type(v) in (int, str) and len(str(v)) <= 256)
                    for k, v in layout.items()):
                raise _FieldError("bad_type", f"{name}.layout: must be an object of at most {MAX_LAYOUT_KEYS} "
                                              f"short string or int values")
            out["layout"] = dict(layout)
    return out


_AUTH = {"auth": (_nullable(_text(1, MAX_AUTH_CHARS)), None)}
# unload/replace/rollback: how long the generation that goes away may drain (seconds; None = the daemon's
# server.drain_timeout_s).
_DEADLINE = {"deadline_s": (_nullable(_float(0.0, MAX_DEADLINE_MS / 1000.0)), None)}
# drain/resume at a balancer: one backend (its endpoint) instead of the balancer itself.
_BACKEND = {"backend": (_nullable(_text(1, MAX_PATH_CHARS)), None)}

# op -> {field: (checker, default or _REQUIRED)}. Defaults are documented in
# the protocol reference; list defaults are copied per request.
OP_FIELDS: dict[str, dict[str, tuple[Checker, Any]]] = {
    "generate": {
        "model": (_nullable(_name), None),
        "prompt": (_tokens(1, MAX_PROMPT_TOKENS), _ABSENT),
        "text": (_text(0, MAX_TEXT_CHARS), _ABSENT),
        "max_tokens": (_int(0, MAX_NEW_TOKENS), DEFAULT_MAX_TOKENS),  # 0: only with prompt_logprobs
        "temperature": (_float(0.0, MAX_TEMPERATURE), 0.0),
        "top_p": (_float(0.0, 1.0, lo_open=True), 1.0),
        "top_k": (_int(0, TOKEN_ID_MAX), 0),
        "seed": (_int(0, UINT64_MAX), 0),
        "stop_token_ids": (_tokens(0, MAX_STOP_TOKEN_IDS), []),
        "stop": (_stop, []),
        "ignore_eos": (_bool, False),
        "deadline_ms": (_nullable(_int(1, MAX_DEADLINE_MS)), None),
        "tenant": (_name, "default"),
        "priority": (_int(PRIORITY_MIN, PRIORITY_MAX), 0),
        "logprobs": (_bool, False),
        # absent unless asked, so a balancer forwards nothing an older board would not know
        "top_logprobs": (_int(0, MAX_TOP), _ABSENT),  # alternatives per token (implies logprobs)
        "prompt_logprobs": (_nullable(_int(0, MAX_TOP)), _ABSENT),  # the prompt's logprobs, this many alternatives
        # penalties and filters beyond top-p/top-k (vLLM's semantics: docs/protocol.md#sampling)
        "presence_penalty": (_float(-2.0, 2.0), _ABSENT),
        "frequency_penalty": (_float(-2.0, 2.0), _ABSENT),
        "repetition_penalty": (_float(0.0, 100.0, lo_open=True), _ABSENT),
        "min_p": (_float(0.0, 1.0), _ABSENT),
        "min_tokens": (_int(0, MAX_NEW_TOKENS), _ABSENT),
        "logit_bias": (_logit_bias, _ABSENT),
        "stream": (_bool, True),
        "continuation": (_tokens(0, MAX_PROMPT_TOKENS), []),
        "constraint": (_nullable(_constraint), _ABSENT),  # structured output: kind + body (absent: none)
        "pool": (_nullable(_name), None),  # balancers: the backend pool to route to (daemons ignore it)
        # speculative decoding for this request: "off" | "ngram" | "draft"; null = the board's speculative.method
        "speculative": (_nullable(_choice(SPECULATIVE_METHODS)), None),
        "handoff": (_handoff, _ABSENT),  # prefill/decode disaggregation (docs/protocol.md#handoff)
        "adapter": (_nullable(_name), _ABSENT),  # a LoRA adapter loaded on the board (docs/lora.md); null = none
    },
    "cancel": {},
    "health": {},
    "stats": {},
    "models": dict(_AUTH),
    "load": {"alias": (_name, _REQUIRED), "package": (_text(1, MAX_PATH_CHARS), _REQUIRED), **_AUTH},
    "unload": {"alias": (_name, _REQUIRED), **_DEADLINE, **_AUTH},
    "replace": {"alias": (_name, _REQUIRED), "package": (_text(1, MAX_PATH_CHARS), _REQUIRED), **_DEADLINE,
                **_AUTH},
    "rollback": {"alias": (_name, _REQUIRED), **_DEADLINE, **_AUTH},
    "drain": {"timeout_ms": (_nullable(_int(0, MAX_DEADLINE_MS)), None), **_AUTH, **_BACKEND},
    "resume": {**_AUTH, **_BACKEND},
    # ping/pong back on after its automatic downgrade: every chip, or `chip`, of every serving generation
    "reenable_inflight": {"chip": (_nullable(_int(0, 1023)), None), **_AUTH},
    # capabilities for this connection (see CAPABILITIES); answered by a `hello` event with those granted
    "hello": {"capabilities": (_capabilities, [])},
    # LoRA adapters (docs/lora.md): `alias` names the adapter, `package` its folder, `base` the model it adapts
    "load_lora": {"alias": (_name, _REQUIRED), "package": (_text(1, MAX_PATH_CHARS), _REQUIRED),
                  "base": (_nullable(_name), None), **_AUTH},
    "unload_lora": {"alias": (_name, _REQUIRED), **_AUTH},
}
assert set(OP_FIELDS) == set(REQUEST_OPS)
# Fields of which a request must carry exactly one: the prompt as token ids or as text.
ONE_OF: dict[str, tuple[str, ...]] = {"generate": ("prompt", "text")}
_ENVELOPE = ("v", "op", "id")


def _read_id(obj: dict) -> str:
    if "id" not in obj:
        raise ProtocolError("missing_field", "id: required")
    rid = obj["id"]
    if type(rid) is not str:
        raise ProtocolError("bad_type", f"id: must be a string, got {_type_name(rid)}")
    if not 1 <= len(rid) <= MAX_ID_CHARS:
        raise ProtocolError("out_of_range", f"id: must be 1-{MAX_ID_CHARS} characters, got {len(rid)}")
    return rid


def validate_request(obj: Any) -> dict:
    """Check one parsed request and return a new dict with every field of its op (defaults filled).

    Raises only `ProtocolError`; its `id` is set once the request id has been read.
    """
    if type(obj) is not dict:
        raise ProtocolError("not_an_object", f"a request must be a JSON object, got {_type_name(obj)}")
    rid = _read_id(obj)
    if "v" not in obj:
        raise ProtocolError("missing_field", "v: required (protocol version)", rid)
    if type(obj["v"]) is not int or obj["v"] != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"v: this server speaks version {PROTOCOL_VERSION}, got {obj['v']!r}"[:200], rid)
    if "op" not in obj:
        raise ProtocolError("missing_field", "op: required", rid)
    op = obj["op"]
    if type(op) is not str:
        raise ProtocolError("bad_type", f"op: must be a string, got {_type_name(op)}", rid)
    fields = OP_FIELDS.get(op)
    if fields is None:
        raise ProtocolError("unknown_op", f"op: unknown op {op[:64]!r}; known: {', '.join(REQUEST_OPS)}", rid)
    unknown = sorted(k for k in obj if k not in fields and k not in _ENVELOPE)
    if unknown:
        raise ProtocolError("unknown_field", f"{unknown[0][:64]}: unknown field for op {op!r}", rid)
    out: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": op, "id": rid}
    for name, (check, default) in fields.items():
        if name in obj:
            try:
                out[name] = check(name, obj[name])
            except _FieldError as e:
                raise ProtocolError(e.reason, e.message, rid) from None
        elif default is _REQUIRED:
            raise ProtocolError("missing_field", f"{name}: required for op {op!r}", rid)
        elif default is not _ABSENT:
            out[name] = list(default) if isinstance(default, list) else default
    one_of = ONE_OF.get(op)
    if one_of:
        given = [k for k in one_of if k in out]
        if not given:
            raise ProtocolError("missing_field", f"{' or '.join(one_of)}: op {op!r} needs one of them", rid)
        if len(given) > 1:
            raise ProtocolError("conflicting_fields", f"{', '.join(given)}: op {op!r} takes exactly one of "
                                                      f"them, got both", rid)
    if op == "generate" and out["max_tokens"] == 0 and out.get("prompt_logprobs") is None:
        raise ProtocolError("out_of_range", "max_tokens: must be >= 1 (0 only with prompt_logprobs)", rid)
    return out


# ---------------------------------------------------------------- events


def _event(ev: str, id: str | None) -> dict:
    return {"v": PROTOCOL_VERSION, "ev": ev, "id": id}


def error_event(id: str | None, code: int, reason: str, message: str, retryable: bool = False,
                retry_after_ms: int | None = None) -> dict:
    """`retry_after_ms`: on a retryable refusal, when to come back (absent when the server cannot say)."""
    assert code in ERROR_CODES, code
    assert REASON_RE.match(reason), reason
    ev = {**_event("error", id), "code": code, "reason": reason, "message": str(message),
          "retryable": bool(retryable)}
    if retry_after_ms is not None:
        assert type(retry_after_ms) is int and 0 <= retry_after_ms <= MAX_RETRY_AFTER_MS, retry_after_ms
        ev["retry_after_ms"] = retry_after_ms
    return ev


def _int_list(tokens: Any) -> list[int]:
    # numpy arrays (what workers hand over) convert in C; lists are copied.
    out = tokens.tolist() if hasattr(tokens, "tolist") else [int(t) for t in tokens]
    assert all(type(t) is int and t >= 0 for t in out), "token ids must be non-negative ints"
    return out


def _logprob_list(logprobs: Any, n: int) -> list[float]:
    out = [float(x) for x in (logprobs.tolist() if hasattr(logprobs, "tolist") else logprobs)]
    assert len(out) == n, "one logprob per token"
    assert all(math.isfinite(x) for x in out), "logprobs must be finite (JSON has no inf/nan)"
    return out


def tokens_event(id: str, tokens: Any, logprobs: Any = None, text: str | None = None, top_logprobs: Any = None,
                 prompt_logprobs: dict | None = None) -> dict:
    """New tokens of a streamed generate; `logprobs` only when the request asked for them.

    `text` is the decoded delta when the model has a tokenizer; it may lag the
    tokens (half a character, a possible stop-string start), so an event may
    carry tokens and no text, or (at the end) text and no tokens.
    """
    ev = {**_event("tokens", id), "tokens": _int_list(tokens)}
    if text is not None:
        assert type(text) is str
        ev["text"] = text
    assert ev["tokens"] or text or prompt_logprobs, "a tokens event carries a token, some text or prompt_logprobs"
    if logprobs is not None:
        ev["logprobs"] = _logprob_list(logprobs, len(ev["tokens"]))
    _add_alternatives(ev, top_logprobs, prompt_logprobs)
    return ev


def _add_alternatives(ev: dict, top_logprobs: Any, prompt_logprobs: dict | None) -> None:
    """`top_logprobs` (per token, [[id, logprob], ...]) and `prompt_logprobs` ({tokens, logprobs, top_logprobs}:
    one entry per prompt token, the first logprob null) of an event, when the request asked for them."""
    if top_logprobs is not None:
        assert len(top_logprobs) == len(ev["tokens"]), "one list of alternatives per token"
        ev["top_logprobs"] = top_logprobs
    if prompt_logprobs is not None:
        ev["prompt_logprobs"] = prompt_logprobs


USAGE_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")
TIMING_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


def done_event(id: str, finish_reason: str, usage: Mapping, timing: Mapping,
               tokens: Any = None, logprobs: Any = None, text: str | None = None, top_logprobs: Any = None,
               prompt_logprobs: dict | None = None) -> dict:
    """The terminal event of a generate. With `stream: false` it also carries every token (and the text)."""
    assert finish_reason in FINISH_REASONS, finish_reason
    assert all(k in usage for k in USAGE_KEYS), f"usage needs {USAGE_KEYS}"
    assert all(k in timing for k in TIMING_KEYS), f"timing needs {TIMING_KEYS}"
    ev = {**_event("done", id), "finish_reason": finish_reason,
          "usage": {k: int(v) for k, v in usage.items()},
          "timing": {k: (None if v is None else float(v)) for k, v in timing.items()}}
    if tokens is not None:
        ev["tokens"] = _int_list(tokens)
        if logprobs is not None:
            ev["logprobs"] = _logprob_list(logprobs, len(ev["tokens"]))
        _add_alternatives(ev, top_logprobs, None)
    if prompt_logprobs is not None:
        ev["prompt_logprobs"] = prompt_logprobs
    if text is not None:
        assert type(text) is str
        ev["text"] = text
    return ev


def reply_event(id: str, ev: str, body: Mapping) -> dict:
    """The single reply to a health/stats/admin op: the body's fields sit beside v/ev/id."""
    assert ev in REPLY_EVENTS, ev
    assert not set(body) & {"v", "ev", "id"}, "body must not override the envelope"
    return {**_event(ev, id), **body}


_event_tokens = _tokens(0, MAX_NEW_TOKENS)  # built once: validate_event runs once per streamed event


def _check_number_or_null(where: str, value: Any) -> None:
    if value is not None and (type(value) not in (int, float) or not math.isfinite(value) or value < 0):
        raise ProtocolError("out_of_range", f"{where}: must be a non-negative number or null, got {value!r}"[:200])


def validate_event(obj: Any) -> dict:
    """Check one parsed server event (what clients and the balancer read). Unknown extra fields pass."""
    if type(obj) is not dict:
        raise ProtocolError("not_an_object", f"an event must be a JSON object, got {_type_name(obj)}")
    eid = obj.get("id")
    if eid is not None and type(eid) is not str:
        raise ProtocolError("bad_type", f"id: must be a string or null, got {_type_name(eid)}")
    if type(obj.get("v")) is not int or obj["v"] != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"v: expected {PROTOCOL_VERSION}, got {obj.get('v')!r}"[:200], eid)
    ev = obj.get("ev")
    if type(ev) is not str or ev not in EVENTS:
        raise ProtocolError("unknown_op", f"ev: unknown event {ev!r}"[:200], eid)
    if eid is None and ev != "error":
        raise ProtocolError("missing_field", f"id: required in a {ev!r} event")
    try:
        if ev == "tokens":
            _event_tokens("tokens", obj.get("tokens"))
            _event_text(obj)
            if not obj["tokens"] and not obj.get("text") and "prompt_logprobs" not in obj:
                raise _FieldError("out_of_range", "tokens: a tokens event carries at least one token or some text")
            _event_logprobs(obj)
            _event_alternatives(obj)
        elif ev == "done":
            if obj.get("finish_reason") not in FINISH_REASONS:
                raise _FieldError("out_of_range", f"finish_reason: must be one of {FINISH_REASONS}")
            usage, timing = obj.get("usage"), obj.get("timing")
            if type(usage) is not dict or type(timing) is not dict:
                raise _FieldError("bad_type", "usage and timing: must be objects")
            for k in USAGE_KEYS:
                _int(0, UINT64_MAX)(f"usage.{k}", usage.get(k))
            for k in TIMING_KEYS:
                if k not in timing:
                    raise _FieldError("missing_field", f"timing.{k}: required")
                _check_number_or_null(f"timing.{k}", timing[k])
            if "tokens" in obj:
                _event_tokens("tokens", obj["tokens"])
                _event_logprobs(obj)
            _event_alternatives(obj)
            _event_text(obj)
        elif ev == "error":
            code = obj.get("code")
            if type(code) is not int or not 100 <= code <= 599:
                raise _FieldError("out_of_range", f"code: must be an HTTP-like int, got {code!r}"[:200])
            for k in ("reason", "message"):
                if type(obj.get(k)) is not str:
                    raise _FieldError("bad_type", f"{k}: must be a string")
            _bool("retryable", obj.get("retryable"))
            if obj.get("retry_after_ms") is not None:
                _int(0, MAX_RETRY_AFTER_MS)("retry_after_ms", obj["retry_after_ms"])
    except _FieldError as e:
        raise ProtocolError(e.reason, e.message, eid) from None
    return obj


def _event_logprobs(obj: dict) -> None:
    lp = obj.get("logprobs")
    if lp is None:
        return
    if type(lp) is not list or len(lp) != len(obj["tokens"]):
        raise _FieldError("bad_type", "logprobs: must be a list with one number per token")
    if not all(type(x) in (int, float) for x in lp):
        raise _FieldError("bad_type", "logprobs: must be numbers")


def _alternatives_ok(tops: Any) -> bool:
    return type(tops) is list and all(
        type(pair) is list and len(pair) == 2 and type(pair[0]) is int and type(pair[1]) in (int, float)
        for pair in tops)


def _event_alternatives(obj: dict) -> None:
    tl = obj.get("top_logprobs")
    if tl is not None and (type(tl) is not list or len(tl) != len(obj.get("tokens") or ())
                           or not all(_alternatives_ok(t) for t in tl)):
        raise _FieldError("bad_type", "top_logprobs: must be a list, per token, of [id, logprob] pairs")
    pl = obj.get("prompt_logprobs")
    if pl is None:
        return
    ok = type(pl) is dict and all(type(pl.get(k)) is list for k in ("tokens", "logprobs", "top_logprobs"))
    if ok:
        n = len(pl["tokens"])
        ok = (len(pl["logprobs"]) == n and len(pl["top_logprobs"]) == n
              and all(x is None or type(x) in (int, float) for x in pl["logprobs"])
              and all(_alternatives_ok(t) for t in pl["top_logprobs"]))
    if not ok:
        raise _FieldError("bad_type", "prompt_logprobs: must be {tokens, logprobs, top_logprobs}, one entry per "
                                      "prompt token each")


def _event_text(obj: dict) -> None:
    if "text" in obj and type(obj["text"]) is not str:
        raise _FieldError("bad_type", f"text: must be a string, got {_type_name(obj['text'])}")
