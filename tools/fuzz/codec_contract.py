"""The contract both wire harnesses hold a codec decoder to: accept and round-trip, or refuse with a 400."""

from __future__ import annotations

from typing import Callable

import orjson

from ipc import codec, schema
from ipc.codec import ProtocolError
from tools.fuzz.finding import Finding


def check_codec(data: bytes, decode: Callable[[bytes], dict], validate: Callable[[object], dict], what: str,
                check_accepted: Callable[[dict], None]) -> None:
    """`decode(data)` either refuses with a 400 codec reason, or returns what `check_accepted` passes and what
    decodes to itself after encoding. A catch-all `bad_json` ("unreadable <what> (...)") hides a foreign
    exception of `validate`: calling it again raises that exception, which is the finding."""
    try:
        obj = decode(data)
    except ProtocolError as e:
        if e.code != 400 or e.reason not in schema.CODEC_REASONS:
            raise Finding(f"rejection is not a 400 codec reason: {e.reason} | {e}") from None
        if e.reason == "bad_json" and e.message.startswith(f"unreadable {what} ("):
            validate(orjson.loads(data))
            raise Finding(f"the {what} check raised a foreign exception | {e}") from None
        return
    check_accepted(obj)
    again = decode(codec.encode(obj))
    if again != obj:
        raise Finding(f"encode -> decode changed the {what} | {str(obj)[:200]} -> {str(again)[:200]}")
