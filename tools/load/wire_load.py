"""A load client that sees every event on the wire, for the soak and chaos invariants.

`AsyncClient` hides what the invariants are about: an event that arrives
after a request's terminal event, or for an id nobody sent, is dropped there
on purpose. This driver keeps one raw DEALER (zmq.asyncio), builds messages
with the client library's own builders, and records every event of every
request: a `Trace` per request with its tokens, timings and terminal events.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from engine.async_client import drain_events
from engine.client import HELLO_ID, build_cancel, build_generate, open_dealer
from ipc.codec import encode
from tools.load.runner import Timed


@dataclass(slots=True)
class Trace(Timed):
    """Everything the wire said about one request."""

    rid: str
    kind: str  # what the load meant it to be (normal, cancel, deadline, ...)
    params: dict
    sent: float = 0.0  # time.monotonic()
    first: float | None = None
    last: float | None = None
    tokens: list[int] = field(default_factory=list)
    terminals: list[dict] = field(default_factory=list)  # done / error events (exactly one is right)
    after_terminal: int = 0  # events of any kind that came after the first terminal event
    cancel_sent: bool = False
    done_at: float | None = None
    unexpected: list = field(default_factory=list)  # events of a kind a generate never gets

    @property
    def terminal(self) -> dict | None:
        return self.terminals[0] if self.terminals else None

    @property
    def error_code(self) -> int | None:
        t = self.terminal
        return t.get("code") if t is not None and t["ev"] == "error" else None

    @property
    def token_count(self) -> int:
        return len(self.tokens)

    def wire_violations(self, full_length: bool = True) -> list[str]:
        """Where the stream broke the protocol's promises (empty = it kept them): exactly one terminal event,
        nothing after it, a `done` whose usage counts the streamed tokens and, with `full_length`, whose
        `length` means all `max_tokens` of them. What the soak and the chaos scenarios check alike."""
        v = []
        if not self.terminals:
            v.append("no terminal event")
        elif len(self.terminals) > 1:
            v.append(f"{len(self.terminals)} terminal events")
        if self.after_terminal:
            v.append(f"{self.after_terminal} event(s) after the terminal event")
        term = self.terminal
        if term is not None and term["ev"] == "done":
            n = (term.get("usage") or {}).get("completion_tokens")
            if n != len(self.tokens):
                v.append(f"usage.completion_tokens {n} != {len(self.tokens)} streamed")
            want = self.params.get("max_tokens")
            if full_length and term.get("finish_reason") == "length" and len(self.tokens) != want:
                v.append(f"finished 'length' with {len(self.tokens)} of {want} tokens")
        return v


class WireLoad:
    """`await start(...)` requests, `await finished(trace)`; every event lands in its Trace."""

    def __init__(self, endpoint: str, *, rcvhwm: int = 0, rcvbuf: int = -1) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = open_dealer(self._ctx, endpoint)
        if rcvhwm:
            self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf > 0:
            self._sock.setsockopt(zmq.RCVBUF, rcvbuf)
        self.traces: dict[str, Trace] = {}
        self.unknown_events: list[dict] = []  # events naming an id this client never sent
        self.undecodable = 0
        self.hello: dict | None = None  # the server's answer to the connection's `hello`
        self.replies: dict[str, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._tag = f"w{os.getpid():x}.{id(self) & 0xFFFF:x}"
        self._waiters: dict[str, asyncio.Event] = {}
        self._cancel_after: dict[str, int] = {}
        self._rx: asyncio.Task | None = None
        self.reading = True  # False: stop reading the socket (the "client that stops reading" scenario)

    def new_id(self) -> str:
        return f"{self._tag}.{next(self._ids)}"

    async def start(self, prompt: list[int], *, kind: str = "normal", cancel_after: int | None = None,
                    **fields) -> Trace:
        """Send one streamed generate; `cancel_after=k` sends a cancel once k tokens have arrived."""
        if self._rx is None:
            self._rx = asyncio.get_running_loop().create_task(self._receive())
        rid = self.new_id()
        tr = Trace(rid, kind, {"prompt": prompt, **fields})
        self.traces[rid] = tr
        self._waiters[rid] = asyncio.Event()
        if cancel_after is not None:
            self._cancel_after[rid] = cancel_after
        tr.sent = time.monotonic()
        await self._sock.send(encode(build_generate(rid, prompt, True, fields)))
        if cancel_after == 0:
            await self.cancel(tr)
        return tr

    async def cancel(self, tr: Trace) -> None:
        tr.cancel_sent = True
        self._cancel_after.pop(tr.rid, None)
        await self._sock.send(encode(build_cancel(tr.rid)))

    async def send_raw(self, frame: bytes) -> None:
        await self._sock.send(frame)

    async def call(self, op: str, timeout: float = 10.0) -> dict:
        """A one-reply op (health, stats) on this same connection."""
        if self._rx is None:
            self._rx = asyncio.get_running_loop().create_task(self._receive())
        rid = self.new_id()
        fut = asyncio.get_running_loop().create_future()
        self.replies[rid] = fut
        await self._sock.send(encode({"v": 1, "op": op, "id": rid}))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.replies.pop(rid, None)

    async def finished(self, tr: Trace, timeout: float | None = None) -> bool:
        """Wait for `tr`'s terminal event; False on timeout."""
        try:
            await asyncio.wait_for(self._waiters[tr.rid].wait(), timeout)
            return True
        except (asyncio.TimeoutError, TimeoutError):
            return False

    def forget(self, tr: Trace) -> None:
        """Drop a finished trace (long runs); a later event for its id counts as an unknown event."""
        self.traces.pop(tr.rid, None)
        self._waiters.pop(tr.rid, None)

    def receiver_error(self) -> BaseException | None:
        """The exception that stopped the receiving task (a bug in this client), if it stopped."""
        if self._rx is not None and self._rx.done() and not self._rx.cancelled():
            return self._rx.exception()
        return None

    def open(self) -> list[Trace]:
        return [t for t in self.traces.values() if not t.terminals]

    async def _receive(self) -> None:
        sock = self._sock
        raw = zmq.Socket.shadow(sock.underlying)
        while True:
            if not self.reading:
                await asyncio.sleep(0.05)
                continue
            await sock.poll(flags=zmq.POLLIN)
            for ev in drain_events(raw):
                if ev is None:
                    self.undecodable += 1
                else:
                    self._on_event(ev, time.monotonic())
                if not self.reading:
                    break

    def _on_event(self, ev: dict, now: float) -> None:
        rid = ev.get("id")
        tr = self.traces.get(rid)
        if tr is None and rid == HELLO_ID and self.hello is None:
            self.hello = ev
            return
        if tr is None:
            fut = self.replies.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(ev)
            else:
                self.unknown_events.append(ev)
            return
        if tr.terminals:
            tr.after_terminal += 1
            if ev.get("ev") in ("done", "error"):
                tr.terminals.append(ev)
            return
        kind = ev.get("ev")
        if kind == "tokens":
            toks = ev.get("tokens") or []
            tr.tokens.extend(toks)
            tr.last = now
            if tr.first is None:
                tr.first = now
            k = self._cancel_after.get(rid)
            if k is not None and len(tr.tokens) >= k:
                self._cancel_after.pop(rid)
                tr.cancel_sent = True
                asyncio.ensure_future(self._sock.send(encode(build_cancel(rid))))
        elif kind in ("done", "error"):
            tr.terminals.append(ev)
            tr.done_at = now
            self._cancel_after.pop(rid, None)
            self._waiters[rid].set()
        else:
            tr.unexpected.append(ev)

    async def drain(self, seconds: float) -> None:
        """Keep receiving for `seconds` (to catch anything sent after a terminal event)."""
        await asyncio.sleep(seconds)

    async def close(self) -> None:
        if self._rx is not None:
            self._rx.cancel()
            try:
                await self._rx
            except (asyncio.CancelledError, Exception):
                pass
        self._sock.close(0)
        self._ctx.term()
