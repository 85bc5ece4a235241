"""asyncio client: the `Client` surface on zmq.asyncio.

One DEALER socket, one receiver task that demultiplexes server events by
request id into per-request queues, so thousands of concurrent requests cost
one socket and one task.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
from typing import AsyncIterator, Iterable, Iterator

import zmq
import zmq.asyncio

from engine.client import (
    Prompt,
    Result,
    ResultBuilder,
    build_cancel,
    build_generate,
    default_endpoint,
    open_dealer,
    reply_body,
)
from engine.errors import ClientError, ClientTimeout, InvalidRequest
from ipc.codec import PROTOCOL_VERSION, ProtocolError, decode_event, decode_trusted_event, encode


def drain_events(raw: zmq.Socket, decode=decode_event) -> Iterator[dict | None]:
    """Every frame ready on `raw` (NOBLOCK receives), decoded; None for one that is not a valid event."""
    while True:
        try:
            data = raw.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            yield decode(data)
        except ProtocolError:
            yield None


def dispatch(events: Iterable[dict | None], queues: dict, unanswered: set[str]) -> None:
    """Put one receive burst's events into their requests' queues (`put_nowait`), first events first.

    The first event of a request that has had none (`unanswered`, updated
    here) goes in before the rest of the burst, so its waiting task wakes
    first: a new request's first tokens do not wait behind every running
    stream's next tokens. Each request's own events keep their order;
    events of unknown requests (and None, a frame that did not decode) are
    dropped.
    """
    later = []
    for ev in events:
        if ev is None:
            continue
        rid = ev.get("id")
        q = queues.get(rid)
        if q is None:
            continue
        if rid in unanswered:
            unanswered.discard(rid)
            q.put_nowait(ev)
        else:
            later.append((q, ev))
    for q, ev in later:
        q.put_nowait(ev)


class _Expired(Exception):
    """An inbox's deadline passed while its reader waited."""


class Inbox:
    """One request's events, in arrival order, for the one task that reads them.

    An asyncio.Queue minus what a single reader of a never-full queue does not need (a deque of getters,
    the loop mixin's checks), plus the request's deadline as one timer (`expire_at`) instead of a
    timeout scope around every wait: the events of a stream are read one at a time, thousands a second
    per client, and the per-event asyncio bookkeeping was most of a client's cost after decoding. Events
    that arrived keep being handed out after the deadline; only a wait on an empty inbox then fails.
    """

    __slots__ = ("events", "_waiter", "_timer", "_expired")

    def __init__(self) -> None:
        self.events: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    def put_nowait(self, ev: dict) -> None:
        self.events.append(ev)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def empty(self) -> bool:
        return not self.events

    def get_nowait(self) -> dict:
        return self.events.popleft()

    async def get(self) -> dict:
        """The next event; raises _Expired when the inbox is empty past its deadline."""
        events = self.events
        while not events:
            if self._expired:
                raise _Expired()
            w = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await w
            finally:
                self._waiter = None
        return events.popleft()

    def expire_at(self, deadline: float | None) -> None:
        """From `deadline` (loop time; None: never) a wait on an empty inbox fails."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadline is not None:
            self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._expired = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class AsyncClient:
    """`AsyncClient(endpoint)`: `await generate(...)`, `async for chunk in stream(...)`, cancel, health, stats.

    Must be created and used inside one running event loop; `await close()`
    (or `async with`) stops the receiver task and closes the socket.
    """

    def __init__(self, endpoint: str | None = None, timeout: float | None = None, *,
                 context: zmq.asyncio.Context | None = None, validate: bool = True,
                 batched_events: bool = True) -> None:
        """`validate=False`: events are parsed without the protocol's per-field checks
        (`ipc.codec.decode_trusted_event`), for a relay whose upstream is our own daemon or balancer.
        `batched_events=False`: one event per message (see `open_dealer`)."""
        self.endpoint = endpoint or default_endpoint()
        self._decode = decode_event if validate else decode_trusted_event
        self.timeout = timeout
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._sock = open_dealer(self._ctx, self.endpoint, batched_events=batched_events)
        self._queues: dict[str, Inbox] = {}
        self._unanswered: set[str] = set()  # requests in flight that have had no event yet
        self._ids = itertools.count(1)
        self._tag = f"{os.getpid():x}.{id(self) & 0xFFFFFF:x}"
        self._receiver: asyncio.Task | None = None
        self._closed = False

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._receiver is not None:
            self._receiver.cancel()
            try:
                await self._receiver
            except (asyncio.CancelledError, Exception):
                pass
        self._sock.close(0)
        if self._own_ctx:
            self._ctx.term()

    def new_id(self) -> str:
        return f"{self._tag}.{next(self._ids)}"

    # -- public API --------------------------------------------------------
    async def generate(self, prompt: Prompt, *, timeout: float | None = ..., id: str | None = None,
                       **sampling) -> Result:
        """Run one request to completion (non-streamed on the wire: one `done` carries all tokens and text).

        `prompt`: token ids, or a `str` the server tokenizes."""
        rid = id or self.new_id()
        deadline = self._deadline(timeout)
        q = await self._start(rid, build_generate(rid, prompt, False, sampling), deadline)
        b = ResultBuilder()
        try:
            while b.result is None:
                b.feed(await self._get(q, rid))
        except ClientTimeout:
            await self._send_quiet(build_cancel(rid))
            raise
        finally:
            self._forget(rid)
        return b.result

    async def generate_choices(self, prompt: Prompt, n: int, *, timeout: float | None = ..., id: str | None = None,
                               **sampling) -> list[Result]:
        """One request with `n` choices (wire field `n`) run to completion: their Results, by `index`. An error of
        any choice raises (the others are cancelled)."""
        rid = id or self.new_id()
        deadline = self._deadline(timeout)
        msg = build_generate(rid, prompt, False, sampling)
        if n != 1:
            msg["n"] = n
        q = await self._start(rid, msg, deadline)
        builders = [ResultBuilder() for _ in range(n)]
        left = n
        try:
            while left:
                ev = await self._get(q, rid)
                builders[ev.get("index", 0) if n > 1 else 0].feed(ev)
                left -= ev.get("ev") == "done"
        except ClientError:
            await self._send_quiet(build_cancel(rid))
            raise
        finally:
            self._forget(rid)
        return [b.result for b in builders]

    def stream(self, prompt: Prompt, *, timeout: float | None = ..., id: str | None = None,
               result: list | None = None, **sampling) -> AsyncIterator[list[int]]:
        """Yield token chunks; leaving the loop early cancels the request on the server (when the iterator
        is closed: `aclose()`, or its collection). The request's own async generator, not a wrapper of it:
        a layer of generator per chunk was a measurable share of a streaming client's cost."""
        return self._stream(prompt, timeout, id, result, sampling, text=False)

    def stream_text(self, prompt: Prompt, *, timeout: float | None = ..., id: str | None = None,
                    result: list | None = None, **sampling) -> AsyncIterator[str]:
        """Yield the decoded text deltas (non-empty, never half a character); like `stream`."""
        return self._stream(prompt, timeout, id, result, sampling, text=True)

    def stream_message(self, msg: dict, *, timeout: float | None = ...,
                       result: list | None = None) -> AsyncIterator[list[int]]:
        """`stream` for a generate message built by the caller (fields this library has no keyword for);
        `msg["id"]` must be unique among this client's requests in flight."""
        return self._stream_message(msg, timeout, result, text=False)

    def _stream(self, prompt: Prompt, timeout, id: str | None, result: list | None, sampling: dict,
                text: bool) -> AsyncIterator:
        rid = id or self.new_id()
        return self._stream_message(build_generate(rid, prompt, True, sampling), timeout, result, text)

    async def _stream_message(self, msg: dict, timeout, result: list | None, text: bool) -> AsyncIterator:
        rid = msg["id"]
        deadline = self._deadline(timeout)
        q = await self._start(rid, msg, deadline)
        b = ResultBuilder()
        finished = False
        try:
            while b.result is None:
                piece = b.piece(await self._get(q, rid), text)
                if piece:
                    yield piece
            finished = True
            if result is not None:
                result.append(b.result)
        except ClientError as e:
            finished = not isinstance(e, ClientTimeout)
            raise
        finally:
            self._forget(rid)
            if not finished and not self._closed:
                await self._send_quiet(build_cancel(rid))

    def stream_batches(self, msg: dict, *, timeout: float | None = ...) -> AsyncIterator[list[dict]]:
        """Yield a generate's events in batches: every event that arrived in one receive burst, as one list.

        For relays (the HTTP front) that coalesce what one loop turn brought
        into one write. The last batch ends with the terminal event (`done` or
        `error`, not raised). `msg["id"]` must be unique among this client's
        requests in flight; leaving the loop early cancels the request.
        """
        return self._batches(msg, timeout, lambda batch: batch[-1].get("ev") in ("done", "error"))

    def choice_batches(self, msg: dict, *, timeout: float | None = ...) -> AsyncIterator[list[dict]]:
        """`stream_batches` of a generate with `n` > 1: its events (each with its choice's `index`) until every
        choice's terminal event, or one without `index` (the request refused whole, e.g. by a server that does
        not know `n`). Leaving the loop early cancels every choice."""
        left = msg["n"]

        def ends(batch: list[dict]) -> bool:
            nonlocal left
            for ev in batch:
                if ev.get("ev") in ("done", "error"):
                    left = left - 1 if "index" in ev else 0
            return left <= 0

        return self._batches(msg, timeout, ends)

    async def _batches(self, msg: dict, timeout, ends) -> AsyncIterator[list[dict]]:
        """A request's events in receive bursts until `ends(batch)` says its last has come; leaving early
        cancels it."""
        rid = msg["id"]
        q = await self._start(rid, msg, self._deadline(timeout))
        finished = False
        try:
            while True:
                batch = [await self._get(q, rid)]
                while not q.empty():
                    batch.append(q.get_nowait())
                if ends(batch):
                    finished = True
                    yield batch
                    return
                yield batch
        finally:
            self._forget(rid)
            if not finished:
                self.cancel_nowait(rid)

    def cancel_nowait(self, id: str) -> None:
        """`cancel` without awaiting (safe in a `finally` of a cancelled task): a non-blocking send."""
        if self._closed:
            return
        try:
            zmq.Socket.shadow(self._sock.underlying).send(encode(build_cancel(id)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def abort_all(self, code: int, reason: str, message: str, retry_after_ms: int | None = None) -> None:
        """End every request in flight with a local `error` event (the upstream is gone; nobody else will)."""
        for rid, q in list(self._queues.items()):
            ev = {"v": PROTOCOL_VERSION, "ev": "error", "id": rid, "code": code, "reason": reason,
                  "message": message, "retryable": True}
            if retry_after_ms is not None:
                ev["retry_after_ms"] = retry_after_ms
            q.put_nowait(ev)

    async def cancel(self, id: str) -> None:
        """Ask the server to cancel request `id` (idempotent; its stream ends with done/cancelled)."""
        await self._send(build_cancel(id))

    async def health(self, *, timeout: float | None = ...) -> dict:
        return await self.call("health", timeout=timeout)

    async def stats(self, *, timeout: float | None = ...) -> dict:
        return await self.call("stats", timeout=timeout)

    async def call(self, op: str, *, timeout: float | None = ..., **fields) -> dict:
        """Send a one-reply op (health, stats, admin ops) and return the reply body."""
        rid = self.new_id()
        deadline = self._deadline(timeout)
        q = await self._start(rid, {"v": PROTOCOL_VERSION, "op": op, "id": rid, **fields}, deadline)
        try:
            return reply_body(await self._get(q, rid))
        finally:
            self._forget(rid)

    # -- internals ---------------------------------------------------------
    def _deadline(self, timeout) -> float | None:
        if timeout is ...:
            timeout = self.timeout
        return None if timeout is None else asyncio.get_running_loop().time() + timeout

    @staticmethod
    async def _get(q: Inbox, rid: str) -> dict:
        try:
            return await q.get()
        except _Expired:
            raise ClientTimeout(f"no answer for {rid!r} within the timeout", reason="timeout", id=rid) from None

    async def _start(self, rid: str, msg: dict, deadline: float | None = None) -> Inbox:
        """Register `rid`'s inbox (failing its waits from `deadline`, loop time) and send `msg`."""
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive_loop())
        if rid in self._queues:
            raise InvalidRequest(f"request id {rid!r} already in flight on this client", code=400,
                                 reason="duplicate_id", id=rid)
        q = Inbox()
        q.expire_at(deadline)
        self._queues[rid] = q
        self._unanswered.add(rid)
        try:
            await self._send(msg)
        except BaseException:
            self._forget(rid)
            raise
        return q

    def _forget(self, rid: str) -> None:
        q = self._queues.pop(rid, None)
        if q is not None:
            q.close()
        self._unanswered.discard(rid)

    async def _send(self, msg: dict) -> None:
        if self._closed:
            raise ClientError("client is closed", code=0, reason="closed")
        await self._sock.send(encode(msg))

    async def _send_quiet(self, msg: dict) -> None:
        try:
            await self._send(msg)
        except (zmq.ZMQError, ClientError):
            pass

    async def _receive_loop(self) -> None:
        """Wait for readability once, then drain every queued frame synchronously and `dispatch` them.

        A plain (shadow) socket does the NOBLOCK receives: one awaited poll per
        burst instead of one future per message, which is most of the
        client's cost at thousands of events per second.
        """
        sock = self._sock
        raw = zmq.Socket.shadow(sock.underlying)
        while True:
            await sock.poll(flags=zmq.POLLIN)
            dispatch(drain_events(raw, self._decode), self._queues, self._unanswered)

