"""Synchronous client for a board daemon or balancer, over the wire protocol of docs/protocol.md.

One DEALER socket carries many concurrent requests; server events are
demultiplexed by the request `id`. The socket is guarded by a lock and the
receiving is done by whichever waiting thread gets there first
("leader/follower"), so a `Client` may be shared between threads without a
background thread to clean up.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import zmq

from engine.errors import ClientError, ClientTimeout, InvalidRequest, error_from_event
from ipc.codec import PROTOCOL_VERSION, ProtocolError, decode_event, encode
from ipc.schema import BATCHED_EVENTS

DEFAULT_ENDPOINT_ENV = "NPUSERVE_ENDPOINT"

# The generate fields a caller may set (docs/protocol.md, `generate`); anything else is a typo.
SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop",
    "ignore_eos", "deadline_ms", "tenant", "priority", "logprobs", "continuation", "pool", "speculative",
    "constraint",  # structured output: {"kind": ..., "body": ...} (docs/protocol.md)
    "top_logprobs", "prompt_logprobs",  # alternatives per token; the prompt's logprobs (docs/protocol.md)
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
    "adapter",  # a LoRA adapter loaded on the board (docs/lora.md)
})

# How long the receiving thread holds the socket lock per poll while other
# threads may want to send; short enough that a sender never waits long.
_POLL_SLICE_S = 0.02


def default_endpoint() -> str:
    """The endpoint `make run` serves on (overridable with $NPUSERVE_ENDPOINT)."""
    env = os.environ.get(DEFAULT_ENDPOINT_ENV)
    if env:
        return env
    from engine.daemon.paths import default_endpoint as _daemon_default

    return _daemon_default()


@dataclass
class Result:
    """A finished generation."""

    tokens: list[int]
    finish_reason: str
    usage: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    logprobs: list[float] | None = None
    id: str = ""
    text: str | None = None  # the decoded output (None when the served model has no tokenizer)
    generation: int | None = None  # the model generation that served it (a board daemon says so)
    top_logprobs: list[list] | None = None  # per token, [[id, logprob], ...] (when asked with top_logprobs)
    prompt_logprobs: dict | None = None  # {tokens, logprobs, top_logprobs} of the prompt (when asked)


Prompt = list[int] | str  # token ids, or text the server tokenizes


def build_generate(rid: str, prompt: Prompt, stream: bool, sampling: dict) -> dict:
    """The `generate` request message; unknown keyword arguments are a caller bug.

    A `str` prompt is sent as `text` (the server tokenizes it), a list as `prompt` token ids.
    """
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown generate argument(s): {', '.join(sorted(unknown))}")
    msg = {"v": PROTOCOL_VERSION, "op": "generate", "id": rid}
    if isinstance(prompt, str):
        msg["text"] = prompt
    else:
        msg["prompt"] = [int(t) for t in prompt]
    msg["stream"] = stream
    for k, v in sampling.items():
        if v is not None:
            msg[k] = v
    return msg


def build_cancel(rid: str) -> dict:
    """The `cancel` request message for request `rid`."""
    return {"v": PROTOCOL_VERSION, "op": "cancel", "id": rid}


# The id of the `hello` a client opens its connection with. Its reply (or, from a server older than `hello`, its
# 400 unknown_op) names no request, so the client drops it like any event of an id it is not waiting for.
HELLO_ID = "~hello"


def build_hello(capabilities: tuple[str, ...] = (BATCHED_EVENTS,)) -> dict:
    """The `hello` request: the capabilities this connection asks for."""
    return {"v": PROTOCOL_VERSION, "op": "hello", "id": HELLO_ID, "capabilities": list(capabilities)}


def open_dealer(ctx: zmq.Context, endpoint: str, curve=None, *, batched_events: bool = True) -> zmq.Socket:
    """The one DEALER socket of a client (sync or asyncio context), connected to `endpoint`.

    LINGER 0: closing never waits for unsent messages. No high-water marks:
    every in-flight request's events must be kept, however many there are.
    `batched_events`: the first message asks the server for several events per
    message (our clients read every frame as one event, so either framing
    works; batching saves the server a send per stream per turn).
    `curve` (`engine.daemon.curve.CurveClientKeys`) authenticates to a CURVE
    tcp:// endpoint; without it, the keys named by $NPUSERVE_CURVE_SECRET_KEY
    and $NPUSERVE_CURVE_SERVER_KEY are used for tcp:// endpoints when both are set.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    if curve is None and endpoint.startswith("tcp://"):
        from engine.daemon.curve import curve_keys_from_env

        curve = curve_keys_from_env()
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey = curve.public, curve.secret
        sock.curve_serverkey = curve.server_public
    sock.connect(endpoint)
    if batched_events:  # queued ahead of every request (no high-water mark, so it cannot block)
        zmq.Socket.shadow(sock.underlying).send(encode(build_hello()), zmq.NOBLOCK)
    return sock


class ResultBuilder:
    """Folds a request's events into a `Result` (streamed tokens and text, or the final `done`)."""

    __slots__ = ("tokens", "logprobs", "texts", "delta", "result", "top_logprobs", "prompt_logprobs")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = None
        self.texts: list[str] | None = None  # text deltas so far (None: the server sends no text)
        self.delta = ""  # the text delta of the last event fed
        self.result: Result | None = None
        self.top_logprobs: list[list] | None = None
        self.prompt_logprobs: dict | None = None

    def feed(self, ev: dict) -> list[int] | None:
        """Consume one event; returns new tokens (tokens event), None otherwise. Raises on error.

        The event's text delta (possibly "") is left in `delta`."""
        kind = ev.get("ev")
        self.delta = ""
        if kind == "tokens":  # once per streamed event: the helpers only when there is something for them
            toks = ev.get("tokens") or []
            self.tokens.extend(toks)
            lp = ev.get("logprobs")
            if lp:
                self._add_logprobs(lp)
            if "top_logprobs" in ev or "prompt_logprobs" in ev:
                self._add_alternatives(ev)
            text = ev.get("text")
            if text is not None:
                self._add_text(text)
            return toks
        if kind == "done":
            if ev.get("tokens"):
                self.tokens.extend(ev["tokens"])
            self._add_logprobs(ev.get("logprobs"))
            self._add_alternatives(ev)
            self._add_text(ev.get("text"))
            text = None if self.texts is None else "".join(self.texts)
            self.result = Result(self.tokens, ev.get("finish_reason", ""), ev.get("usage") or {},
                                 ev.get("timing") or {}, self.logprobs, ev.get("id", ""), text,
                                 ev.get("generation"), self.top_logprobs, self.prompt_logprobs)
            return None
        if kind == "error":
            raise error_from_event(ev)
        raise ClientError(f"unexpected event {kind!r}", code=500, reason="protocol")

    def piece(self, ev: dict, text: bool) -> list[int] | str | None:
        """`feed`, then what a stream yields for the event: its text delta (`text`) or its new tokens."""
        toks = self.feed(ev)
        return self.delta if text else toks

    def _add_text(self, text: str | None) -> None:
        if isinstance(text, str):
            if self.texts is None:
                self.texts = []
            self.texts.append(text)
            self.delta = text

    def _add_alternatives(self, ev: dict) -> None:
        tl = ev.get("top_logprobs")
        if tl:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs.extend(tl)
        if ev.get("prompt_logprobs") is not None:
            self.prompt_logprobs = ev["prompt_logprobs"]

    def _add_logprobs(self, lp: list[float] | None) -> None:
        if lp:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(lp)


def reply_body(ev: dict) -> dict:
    """A health/stats reply without its envelope fields; error events raise."""
    if ev.get("ev") == "error":
        raise error_from_event(ev)
    return {k: v for k, v in ev.items() if k not in ("v", "ev", "id")}


class Client:
    """`Client(endpoint)`: generate / stream / cancel / health / stats over one socket.

    `timeout` (seconds, None = wait forever) is the default per-call limit; every
    call also takes `timeout=`. A call that times out cancels its request on the
    server and raises `ClientTimeout`.
    """

    def __init__(self, endpoint: str | None = None, timeout: float | None = None, *,
                 context: zmq.Context | None = None, curve=None, batched_events: bool = True) -> None:
        """`batched_events=False`: do not ask for several events per message (one event per message, as a
        client that never sends `hello` is served)."""
        self.endpoint = endpoint or default_endpoint()
        self.timeout = timeout
        self._ctx = context or zmq.Context.instance()
        self._sock = open_dealer(self._ctx, self.endpoint, curve, batched_events=batched_events)
        self._sock_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queues: dict[str, collections.deque] = {}
        self._receiving = False
        self._ids = itertools.count(1)
        self._tag = f"{os.getpid():x}.{id(self) & 0xFFFFFF:x}"
        self._closed = False

    # -- lifecycle ---------------------------------------------------------
    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with self._sock_lock:
                self._sock.close(0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- public API --------------------------------------------------------
    def new_id(self) -> str:
        return f"{self._tag}.{next(self._ids)}"

    def generate(self, prompt: Prompt, *, timeout: float | None = ..., id: str | None = None,
                 **sampling) -> Result:
        """Run one request to completion (non-streamed on the wire: one `done` carries all tokens and text).

        `prompt`: token ids, or a `str` the server tokenizes."""
        rid = id or self.new_id()
        deadline = self._deadline(timeout)
        self._start(rid, build_generate(rid, prompt, False, sampling))
        b = ResultBuilder()
        try:
            while b.result is None:
                b.feed(self._next(rid, deadline))
        except ClientTimeout:
            self._abandon(rid, cancel=True)
            raise
        finally:
            self._forget(rid)
        return b.result

    def stream(self, prompt: Prompt, *, timeout: float | None = ..., id: str | None = None,
               result: list | None = None, **sampling) -> Iterator[list[int]]:
        """Yield token chunks as the server streams them.

        Closing the iterator early cancels the request. Pass a list as
        `result` to receive the final `Result` (usage, timing, text) appended to it.
        """
        rid = id or self.new_id()
        deadline = self._deadline(timeout)
        self._start(rid, build_generate(rid, prompt, True, sampling))
        return self._stream_iter(rid, deadline, result, text=False)

    def stream_text(self, prompt: Prompt, *, timeout: float | None = ..., id: str | None = None,
                    result: list | None = None, **sampling) -> Iterator[str]:
        """Yield the decoded text as the server streams it (non-empty deltas; never half a character).

        Like `stream`; the token ids are in the final `Result` (`result=`)."""
        rid = id or self.new_id()
        deadline = self._deadline(timeout)
        self._start(rid, build_generate(rid, prompt, True, sampling))
        return self._stream_iter(rid, deadline, result, text=True)

    def _stream_iter(self, rid: str, deadline: float | None, sink: list | None, text: bool) -> Iterator:
        b = ResultBuilder()
        finished = False
        try:
            while b.result is None:
                piece = b.piece(self._next(rid, deadline), text)
                if piece:
                    yield piece
            finished = True
            if sink is not None:
                sink.append(b.result)
        except ClientError as e:
            finished = not isinstance(e, ClientTimeout)
            raise
        finally:
            if not finished:
                self._abandon(rid, cancel=True)
            self._forget(rid)

    def cancel(self, id: str) -> None:
        """Ask the server to cancel request `id` (idempotent; its stream ends with done/cancelled)."""
        self._send(build_cancel(id))

    def health(self, *, timeout: float | None = ...) -> dict:
        return self.call("health", timeout=timeout)

    def stats(self, *, timeout: float | None = ...) -> dict:
        return self.call("stats", timeout=timeout)

    def call(self, op: str, *, timeout: float | None = ..., **fields) -> dict:
        """Send a one-reply op (health, stats, admin ops) and return the reply body."""
        rid = self.new_id()
        deadline = self._deadline(timeout)
        self._start(rid, {"v": PROTOCOL_VERSION, "op": op, "id": rid, **fields})
        try:
            return reply_body(self._next(rid, deadline))
        finally:
            self._forget(rid)

    def send_raw(self, frame: bytes) -> None:
        """Send arbitrary bytes (protocol tests); replies for ids registered with `expect` are kept."""
        with self._sock_lock:
            self._sock.send(frame)

    def expect(self, rid: str) -> None:
        with self._cv:
            self._queues.setdefault(rid, collections.deque())

    def next_event(self, rid: str, timeout: float | None = ...) -> dict:
        """The next event for `rid` (after `expect`/`send_raw`); raises ClientTimeout."""
        return self._next(rid, self._deadline(timeout))

    # -- internals ---------------------------------------------------------
    def _deadline(self, timeout) -> float | None:
        if timeout is ...:
            timeout = self.timeout
        return None if timeout is None else time.monotonic() + timeout

    def _start(self, rid: str, msg: dict) -> None:
        with self._cv:
            if rid in self._queues:
                raise InvalidRequest(f"request id {rid!r} already in flight on this client", code=400,
                                     reason="duplicate_id", id=rid)
            self._queues[rid] = collections.deque()
        try:
            self._send(msg)
        except BaseException:
            self._forget(rid)
            raise

    def _send(self, msg: dict) -> None:
        data = encode(msg)
        with self._sock_lock:
            if self._closed:
                raise ClientError("client is closed", code=0, reason="closed")
            self._sock.send(data)

    def _forget(self, rid: str) -> None:
        with self._cv:
            self._queues.pop(rid, None)

    def _abandon(self, rid: str, cancel: bool) -> None:
        self._forget(rid)
        if cancel and not self._closed:
            try:
                self.cancel(rid)
            except zmq.ZMQError:
                pass

    def _next(self, rid: str, deadline: float | None) -> dict:
        while True:
            with self._cv:
                q = self._queues.get(rid)
                if q is None:
                    raise ClientError(f"request {rid!r} is not in flight", code=0, reason="unknown_id")
                if q:
                    return q.popleft()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ClientTimeout(f"no answer for {rid!r} within the timeout", reason="timeout", id=rid)
                if self._receiving:
                    self._cv.wait(remaining)
                    continue
                self._receiving = True
            try:
                frames = self._recv_some(remaining)
            finally:
                with self._cv:
                    self._receiving = False
                    self._dispatch(frames)
                    self._cv.notify_all()

    def _recv_some(self, remaining: float | None) -> list[bytes]:
        """Wait (bounded slices under the socket lock) and drain every frame that is ready."""
        slice_s = _POLL_SLICE_S if remaining is None else min(remaining, _POLL_SLICE_S)
        out: list[bytes] = []
        with self._sock_lock:
            if self._closed:
                raise ClientError("client is closed", code=0, reason="closed")
            if self._sock.poll(int(slice_s * 1000) + 1, zmq.POLLIN):
                try:
                    while len(out) < 4096:
                        out.append(self._sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    pass
        return out

    def _dispatch(self, frames: list[bytes]) -> None:
        for data in frames:
            try:
                ev = decode_event(data)
            except ProtocolError:
                continue  # a frame we cannot read names no request we could route it to
            q = self._queues.get(ev.get("id"))
            if q is not None:
                q.append(ev)
