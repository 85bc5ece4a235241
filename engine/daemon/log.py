"""One JSON object per line on stderr: what the daemon did, for humans and journald."""

from __future__ import annotations

import sys
import time

import orjson


def log(event: str, **fields) -> None:
    rec = {"ts": round(time.time(), 3), "event": event, **fields}
    try:
        line = orjson.dumps(rec, default=str)
    except TypeError:
        line = orjson.dumps({"ts": rec["ts"], "event": event, "fields": repr(fields)})
    try:
        sys.stderr.buffer.write(line + b"\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
