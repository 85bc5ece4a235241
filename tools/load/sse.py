"""A sans-I/O server-sent-events decoder: bytes in, (event, data) pairs out.

The load driver reads OpenAI-style streams (`data: {...}` blocks, `data:
[DONE]`) at tens of thousands of events per second from one process, so this
splits whole blocks at once instead of walking the stream line by line (what
`httpx-sse` and the `openai` package do). It follows the parts of the
WHATWG event-stream format such servers use: `\\n`, `\\r\\n` or `\\r` line
ends, several `data:` lines joined by `\\n`, one optional space after the
colon, `event:`, comment lines (`: ping`) and unknown fields ignored, a block without
data dispatches nothing; and llama.cpp's non-standard `error:` field, read as
an `error` event.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str  # "message" unless the block named one (`event: error`)
    data: bytes


class SseDecoder:
    """`feed(chunk)` returns the events completed by `chunk`; a partial block waits for the next one."""

    __slots__ = ("_buf", "_cr")

    def __init__(self) -> None:
        self._buf = b""
        self._cr = False  # the chunk before ended in \r: a \n starting this one belongs to it

    def feed(self, chunk: bytes) -> list[SseEvent]:
        if not chunk:
            return []
        if self._cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._cr = chunk.endswith(b"\r")
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self._buf + chunk
        if b"\n\n" not in buf:
            self._buf = buf
            return []
        *blocks, self._buf = buf.split(b"\n\n")
        out = []
        for block in blocks:
            ev = _block(block)
            if ev is not None:
                out.append(ev)
        return out

    @property
    def pending(self) -> bytes:
        """What has arrived of a block not yet ended (a stream that stops here was cut off)."""
        return self._buf


def _block(block: bytes) -> SseEvent | None:
    if block.startswith(b"data: ") and b"\n" not in block:  # the common case: one data line
        return SseEvent("message", block[6:])
    event = "message"
    data: list[bytes] = []
    for line in block.split(b"\n"):
        if not line or line.startswith(b":"):
            continue
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value.decode("utf-8", "replace")
        elif name == b"error":  # llama.cpp's server has sent `error: {...}` blocks mid-stream
            event = "error"
            data.append(value)
    if not data:
        return None
    return SseEvent(event, b"\n".join(data))
