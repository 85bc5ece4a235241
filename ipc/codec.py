"""The wire codec: bytes <-> validated protocol dicts (one orjson object per message).

This is the only place in npuserve that parses raw message bytes. Decoding
never raises anything but `ProtocolError`, whatever it is fed: a daemon that
catches that one exception can answer with `err.to_event()` and keep serving.
The per-op rules live in `ipc.schema`.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from ipc.schema import PROTOCOL_VERSION, ProtocolError, validate_event, validate_request

__all__ = ["PROTOCOL_VERSION", "MAX_MESSAGE_BYTES", "ProtocolError", "encode", "decode_request",
           "decode_event", "decode_trusted_event", "validate_request", "validate_event"]

MAX_MESSAGE_BYTES = 1 << 20
# An oversized message is not parsed; its id is looked for only near the start
# (clients put v/op/id first), so answering costs O(1) whatever its size.
_ID_SCAN_BYTES = 4096
_ID_RE = re.compile(rb'"id"\s*:\s*"([^"\\\x00-\x1f]{1,128})"')


def encode(obj: dict) -> bytes:
    """Serialise one message. numpy scalars and arrays are accepted (as JSON numbers and lists)."""
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def _parse(data: Any, max_bytes: int) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("bad_json", f"a message must be bytes, got {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_bytes:
        head = bytes(data[:_ID_SCAN_BYTES])
        m = _ID_RE.search(head)
        rid = m.group(1).decode("utf-8", "replace") if m else None
        raise ProtocolError("too_large", f"message of {size} bytes exceeds the limit of {max_bytes} bytes", rid)
    try:
        return orjson.loads(data)
    except Exception as e:  # orjson.JSONDecodeError, plus anything a foreign buffer may raise
        raise ProtocolError("bad_json", f"not valid JSON: {str(e)[:160]}") from None


def decode_trusted_event(data: Any, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """Parse one event from a trusted upstream (our own daemon or balancer) without the per-field checks.

    For relays on the per-token path (the HTTP front), where `validate_event` is a large share of the cost
    of each event; what they read they read with defaults. Raises only ProtocolError (not an object)."""
    obj = _parse(data, max_bytes)
    if type(obj) is not dict:
        raise ProtocolError("not_an_object", "an event must be a JSON object")
    return obj


def decode_request(data: Any, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """Parse and validate one client request; defaults are filled in. Raises only ProtocolError."""
    try:
        return validate_request(_parse(data, max_bytes))
    except ProtocolError:
        raise
    except Exception as e:  # a bug in validation must still look like a rejected message
        raise ProtocolError("bad_json", f"unreadable request ({type(e).__name__})") from None


def decode_event(data: Any, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """Parse and check one server event (clients, balancer). Raises only ProtocolError."""
    try:
        return validate_event(_parse(data, max_bytes))
    except ProtocolError:
        raise
    except Exception as e:
        raise ProtocolError("bad_json", f"unreadable event ({type(e).__name__})") from None
