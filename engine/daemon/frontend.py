"""The client-facing side of the daemon: ROUTER sockets and per-request bookkeeping.

It maps each (connection, client id) to the core's integer request id and
back, turns core outputs into wire events, and never blocks: sends are
NOBLOCK with ROUTER_MANDATORY. A client that has gone away is detected at the
next send; a client whose send queue (SNDHWM = server.max_send_queue) is full
is "blocked": its streams keep coalescing tokens and its terminal events wait
in a small overflow queue until it reads again. A client blocked for
CLIENT_STALL_S, or whose overflow exceeds max_send_queue, is dropped. The
requests of dropped clients are handed back to the loop to be cancelled.

Token events are coalesced: tokens emitted for one request during one loop
turn leave as one `tokens` event (`flush()`), which keeps the per-token cost
out of the socket path. Every message carries exactly one event, as v1 was
published, unless the connection asked for `batched_events` with `hello`:
then a turn's token events to it leave as the frames of one message. A request with `stream: false` gets no `tokens`
events; its `done` carries every token. When the model has a tokenizer the
core's decoded text deltas ride along: `text` in each `tokens` event (and the
whole text in a non-streamed `done`).
"""

from __future__ import annotations

import collections
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import orjson
import zmq

from engine.daemon.auth import Peer
from engine.daemon.log import log
from ipc.codec import PROTOCOL_VERSION, ProtocolError, decode_request, encode
from ipc.schema import BATCHED_EVENTS, CAPABILITIES, done_event, error_event, reply_event, tokens_event

_MORE = zmq.SNDMORE | zmq.NOBLOCK
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def _event_envelope(ev: str, cid: str) -> dict:
    return {"v": PROTOCOL_VERSION, "ev": ev, "id": cid}

# A client whose send queue stays full this long has its requests cancelled.
CLIENT_STALL_S = 10.0
# A frame larger than this many times max_message_bytes makes libzmq drop the
# connection (protects memory); smaller oversized frames get a 400 reply.
_HARD_FRAME_FACTOR = 16
# Connections remembered as having asked for batched events. ROUTER sockets hear of no disconnect, so the
# set is bounded: forgetting the oldest only sends it one event per message again, which every client reads.
MAX_BATCHED_CONNS = 4096


class Conn(NamedTuple):
    """Where replies go: the ROUTER socket index and the routing envelope.

    A NamedTuple (hashed in C): each turn's token events are grouped by connection, one lookup per event."""

    sock: int
    envelope: tuple[bytes, ...]
    local: bool  # arrived on an ipc:// endpoint (filesystem permissions guard it)
    peer: Peer | None = None  # the authenticated client key (CURVE endpoints only)


@dataclass(slots=True)
class Stream:
    """One in-flight generate as the frontend sees it."""

    rid: int
    conn: Conn
    cid: str
    stream: bool
    pending: list[int] = field(default_factory=list)  # tokens not yet sent (stream) / all tokens (non-stream)
    pending_lp: list[float] | None = None
    pending_text: list[str] | None = None  # text deltas not yet sent / all text (None: no tokenizer)
    tokens_prefix: bytes = b""  # the encoded tokens-event envelope up to the token list (hot path)
    generation: int = 0  # the model generation serving it (its `done` says so); 0: not known
    handoff: dict | None = None  # a prefill leg's hand-off descriptor, sent in its `done`
    pending_top: list | None = None  # alternatives of the pending tokens (requests that asked for them)
    prompt_lp: dict | None = None  # the prompt's logprobs, until sent (requests that asked for them)

    def __post_init__(self) -> None:
        self.tokens_prefix = encode(_event_envelope("tokens", self.cid))[:-1] + b',"tokens":'


@dataclass
class FrontendCounters:
    messages_in: int = 0
    protocol_errors: int = 0
    requests: int = 0
    events_out: int = 0
    tokens_out: int = 0
    duplicate_ids: int = 0
    blocked_clients: int = 0  # times a client's send queue was full (its tokens coalesce meanwhile)
    dropped_clients: int = 0  # peer gone, or stalled/overflowing: its requests cancelled
    dropped_events: int = 0
    hellos: int = 0
    batched_messages: int = 0  # messages that carried several events (to connections that asked for it)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Frontend:
    """ROUTER socket(s) on the configured endpoints plus the request <-> connection maps. Loop thread only."""

    def __init__(self, ctx: zmq.Context, endpoints: list[str], *, max_message_bytes: int,
                 max_send_queue: int, clock: Callable[[], float] = time.monotonic, secure=None) -> None:
        assert endpoints, "at least one endpoint"
        self.max_message_bytes = max_message_bytes
        self.max_send_queue = max_send_queue
        self.clock = clock
        self._blocked: dict[Conn, _Blocked] = {}
        self.sockets: list[zmq.Socket] = []
        self._raw_send: list[Callable] = []  # per socket: its send without the sugar wrapper
        self.local: list[bool] = []
        self.secured: list[bool] = []  # CURVE sockets: messages carry the client key's User-Id
        self._security = secure  # engine.daemon.curve.CurveSetup or None
        self.endpoints = list(endpoints)
        self.counters = FrontendCounters()
        self._by_rid: dict[int, Stream] = {}
        self._by_key: dict[tuple[Conn, str], int] = {}
        self._dirty: dict[int, Stream] = {}  # streams with pending tokens this turn
        self._dead: set[Conn] = set()
        self._batched: collections.OrderedDict[Conn, None] = collections.OrderedDict()
        try:
            for ep in endpoints:
                s = ctx.socket(zmq.ROUTER)
                self.sockets.append(s)
                s.setsockopt(zmq.LINGER, 500)
                s.setsockopt(zmq.ROUTER_MANDATORY, 1)
                s.setsockopt(zmq.SNDHWM, max_send_queue)
                s.setsockopt(zmq.RCVHWM, max(1000, max_send_queue))
                s.setsockopt(zmq.MAXMSGSIZE, max_message_bytes * _HARD_FRAME_FACTOR)
                self.secured.append(bool(secure is not None and secure.server_socket_options(s, ep)))
                s.bind(ep)
                self.local.append(ep.startswith("ipc://"))
                # pyzmq's own send, under the Python-level wrapper (routing ids and groups, which a ROUTER
                # never uses): a frame per streamed event, and the wrapper was half of each send's cost
                self._raw_send.append(super(zmq.Socket, s).send)
        except BaseException:
            self.close(0)
            raise

    def close(self, linger_ms: int = 500) -> None:
        for s in self.sockets:
            s.close(linger_ms)
        self.sockets = []
        self._raw_send = []

    # -- inbound ---------------------------------------------------------------
    def receive(self, idx: int, limit: int = 256) -> list[tuple[Conn, dict]]:
        """Decode up to `limit` waiting messages; malformed ones are answered here and yield no request."""
        sock = self.sockets[idx]
        local = self.local[idx]
        secured = self.secured[idx]
        out: list[tuple[Conn, dict]] = []
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=not secured)
            except zmq.Again:
                break
            self.counters.messages_in += 1
            if len(frames) < 2:
                continue  # a ROUTER always prepends the identity; nothing to answer
            if secured:
                peer = self._security.peer(frames[-1].get("User-Id"))
                frames = [f.bytes for f in frames]
                conn = Conn(idx, tuple(frames[:-1]), local, peer)
            else:
                conn = Conn(idx, tuple(frames[:-1]), local)
            try:
                msg = decode_request(frames[-1], max_bytes=self.max_message_bytes)
            except ProtocolError as e:
                self.counters.protocol_errors += 1
                self.send(conn, e.to_event())
                continue
            if msg["op"] == "hello":
                self._hello(conn, msg)
                continue
            out.append((conn, msg))
        return out

    def _hello(self, conn: Conn, msg: dict) -> None:
        """Grant the capabilities this server has of those asked for; the connection's framing follows them."""
        self.counters.hellos += 1
        granted = [c for c in CAPABILITIES if c in msg["capabilities"]]
        if BATCHED_EVENTS in granted:
            self._batched[conn] = None
            self._batched.move_to_end(conn)
            while len(self._batched) > MAX_BATCHED_CONNS:
                self._batched.popitem(last=False)
        else:
            self._batched.pop(conn, None)
        self.reply(conn, msg["id"], "hello", {"capabilities": granted})

    def batched(self, conn: Conn) -> bool:
        """Whether `conn` asked for several events per message."""
        return conn in self._batched

    # -- request bookkeeping -----------------------------------------------------
    def open(self, rid: int, conn: Conn, cid: str, stream: bool, logprobs: bool, text: bool = False,
             generation: int = 0) -> bool:
        """Register a generate; False when `cid` is already in flight on this connection.

        `text`: the model has a tokenizer, so the request's events carry text."""
        key = (conn, cid)
        if key in self._by_key:
            self.counters.duplicate_ids += 1
            return False
        assert rid not in self._by_rid
        st = Stream(rid, conn, cid, stream, pending_lp=[] if logprobs else None, pending_text=[] if text else None,
                    generation=generation)
        self._by_rid[rid] = st
        self._by_key[key] = rid
        self.counters.requests += 1
        return True

    def set_handoff(self, rid: int, desc: dict) -> None:
        st = self._by_rid.get(rid)
        if st is not None:
            st.handoff = desc

    def lookup(self, conn: Conn, cid: str) -> int | None:
        return self._by_key.get((conn, cid))

    def active(self) -> int:
        return len(self._by_rid)

    def _close(self, st: Stream) -> None:
        del self._by_rid[st.rid]
        del self._by_key[(st.conn, st.cid)]
        self._dirty.pop(st.rid, None)

    # -- outbound ----------------------------------------------------------------
    def emit(self, rid: int, tokens: list[int], logprobs: list[float] | None, text: str | None = None,
             top_logprobs: list | None = None, prompt_logprobs: dict | None = None) -> None:
        st = self._by_rid.get(rid)
        if st is None:
            return  # request of a dropped client
        if top_logprobs is not None or prompt_logprobs is not None:
            self._alternatives(st, tokens, top_logprobs, prompt_logprobs)
        elif st.pending_top is not None:
            st.pending_top.extend([] for _ in tokens)
        st.pending.extend(tokens)
        if text is not None:
            if st.pending_text is None:  # a balancer learns from its backend's events that the model has text
                st.pending_text = []
            st.pending_text.append(text)
        if st.pending_lp is not None:
            st.pending_lp.extend(logprobs if logprobs is not None else [0.0] * len(tokens))
        if st.stream:
            self._dirty[rid] = st

    def _alternatives(self, st: Stream, tokens: list[int], top: list | None, prompt: dict | None) -> None:
        """Keep alternatives beside the pending tokens (the rare path: requests that asked for them)."""
        if prompt is not None:
            st.prompt_lp = prompt
            if st.stream:
                self._dirty[st.rid] = st
        if top is not None:
            if st.pending_top is None:
                st.pending_top = [[] for _ in st.pending]
            st.pending_top.extend(top)
        elif st.pending_top is not None:
            st.pending_top.extend([] for _ in tokens)

    def finish(self, rid: int, finish_reason: str, usage: dict, timing: dict) -> None:
        st = self._by_rid.get(rid)
        if st is None:
            return
        if st.stream:
            self._flush_one(st, final=True)
            ev = done_event(st.cid, finish_reason, usage, _timing(timing))
        else:
            ev = done_event(st.cid, finish_reason, usage, _timing(timing), tokens=st.pending,
                            logprobs=st.pending_lp,
                            text=None if st.pending_text is None else "".join(st.pending_text),
                            top_logprobs=st.pending_top, prompt_logprobs=st.prompt_lp)
            self.counters.tokens_out += len(st.pending)
        if st.generation:
            ev["generation"] = st.generation
        if st.handoff is not None:  # an export leg's hand-off descriptor, for the decode leg
            ev["handoff"] = st.handoff
        self._close(st)
        self.send(st.conn, ev)

    def fail(self, rid: int, code: int, reason: str, message: str, retryable: bool,
             retry_after_ms: int | None = None) -> None:
        st = self._by_rid.get(rid)
        if st is None:
            return
        if st.stream:
            self._flush_one(st, final=True)
        self._close(st)
        self.send(st.conn, error_event(st.cid, code, reason, message, retryable, retry_after_ms))

    def reply(self, conn: Conn, cid: str, ev: str, body: dict) -> None:
        self.send(conn, reply_event(cid, ev, body))

    def error(self, conn: Conn, cid: str | None, code: int, reason: str, message: str,
              retryable: bool = False, retry_after_ms: int | None = None) -> None:
        self.send(conn, error_event(cid, code, reason, message, retryable, retry_after_ms))

    def handle_guarded(self, handle: Callable, owner, conn: Conn, msg: dict, now: float) -> list:
        """`handle(owner, conn, msg, now)` for one request; a bug it trips costs that request a 500 (as its
        terminal event if it was opened), logged, not the process."""
        try:
            return handle(owner, conn, msg, now)
        except Exception as exc:
            log("request_failed", op=msg.get("op"), error=repr(exc), traceback=traceback.format_exc())
            message = f"internal error: {type(exc).__name__}"
            rid = self.lookup(conn, msg["id"])
            if rid is not None:
                self.fail(rid, 500, "internal", message, False)
            else:
                self.error(conn, msg["id"], 500, "internal", message)
            return []

    def flush(self) -> list[int]:
        """Send this turn's coalesced tokens; return request ids of clients found dead (to cancel)."""
        if self._blocked:
            self._retry_blocked()
        if self._dirty:
            dirty = self._dirty
            self._dirty = {}
            # Grouped by connection: one that asked for batched events gets them as the frames of one message
            # (a send per connection per turn); any other gets one message per event.
            by_conn: dict[Conn, list[bytes]] = {}
            live = self._by_rid
            for st in dirty.values():
                if st.rid in live:
                    payload = self._tokens_payload(st)
                    if payload is not None:
                        by_conn.setdefault(st.conn, []).append(payload)
            batched = self._batched
            for conn, payloads in by_conn.items():
                if len(payloads) == 1:
                    self.send_bytes(conn, payloads[0])
                elif conn in batched:
                    self.send_frames(conn, payloads)
                else:
                    for p in payloads:
                        self.send_bytes(conn, p)
        return self.take_dead()

    def _flush_one(self, st: Stream, final: bool = False) -> None:
        payload = self._tokens_payload(st, final)
        if payload is not None:
            self.send_bytes(st.conn, payload)

    def _tokens_payload(self, st: Stream, final: bool = False) -> bytes | None:
        """The tokens event of what `st` holds (taking it), or None when there is nothing to send now."""
        prompt_lp = st.prompt_lp
        if not st.pending and not st.pending_text and prompt_lp is None:
            return None
        if not final and self._blocked and st.conn in self._blocked:
            return None  # keep coalescing until the client drains its queue
        top = st.pending_top
        if top is not None or prompt_lp is not None:
            st.pending_top = [] if top is not None else None
            st.prompt_lp = None
        toks = st.pending
        lp = st.pending_lp
        st.pending = []
        if lp is not None:
            st.pending_lp = []
        text = None
        if st.pending_text is not None:
            text = "".join(st.pending_text)
            st.pending_text = []
            if not toks and not text and prompt_lp is None:
                return None
        self.counters.tokens_out += len(toks)
        if top is not None or prompt_lp is not None:
            return encode(tokens_event(st.cid, toks, lp, text, top, prompt_lp))
        if lp is None:
            # Same bytes as encode(tokens_event(...)) without building the dict: one event per token is
            # the daemon's hottest path.
            tail = b"}" if text is None else b',"text":' + orjson.dumps(text) + b"}"
            return st.tokens_prefix + orjson.dumps(toks, option=_NUMPY) + tail
        return encode(tokens_event(st.cid, toks, lp, text))

    def send(self, conn: Conn, event: dict) -> None:
        self.send_bytes(conn, encode(event))

    def send_bytes(self, conn: Conn, payload: bytes) -> None:
        if self._dead and conn in self._dead:
            self.counters.dropped_events += 1
            return
        if self._blocked:
            b = self._blocked.get(conn)
            if b is not None:
                b.queue.append(payload)
                if len(b.queue) > self.max_send_queue:
                    self._mark_dead(conn)
                return
        if self._try_send(conn, payload) is _AGAIN:
            self._blocked[conn] = _Blocked(self.clock(), collections.deque([payload]))
            self.counters.blocked_clients += 1

    def send_frames(self, conn: Conn, payloads: list[bytes]) -> None:
        """Several events to one client that asked for `batched_events`, as the frames of one message (atomic:
        all or, queue full, none)."""
        assert conn in self._batched, "several events in one message only to a connection that asked for it"
        if self._dead and conn in self._dead:
            self.counters.dropped_events += len(payloads)
            return
        if self._blocked:
            b = self._blocked.get(conn)
            if b is not None:
                b.queue.extend(payloads)
                if len(b.queue) > self.max_send_queue:
                    self._mark_dead(conn)
                return
        send = self._raw_send[conn.sock]
        try:
            for frame in conn.envelope:
                send(frame, _MORE)
            last = len(payloads) - 1
            for i, p in enumerate(payloads):
                send(p, zmq.NOBLOCK if i == last else _MORE)
            self.counters.events_out += len(payloads)
            self.counters.batched_messages += 1
        except zmq.Again:  # only the first frame can meet a full queue: nothing was sent
            self._blocked[conn] = _Blocked(self.clock(), collections.deque(payloads))
            self.counters.blocked_clients += 1
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._mark_dead(conn)

    def _try_send(self, conn: Conn, payload: bytes) -> object:
        send = self._raw_send[conn.sock]
        try:
            # A multipart message is atomic: only the first frame can meet a full queue or a gone peer.
            for frame in conn.envelope:
                send(frame, _MORE)
            send(payload, zmq.NOBLOCK)
            self.counters.events_out += 1
            return None
        except zmq.Again:
            return _AGAIN  # the client's queue is full: it does not keep up (for now)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._mark_dead(conn)
            return None

    def _retry_blocked(self) -> None:
        """Resume clients whose queue drained; drop those stalled for longer than CLIENT_STALL_S."""
        now = self.clock()
        for conn, b in list(self._blocked.items()):
            while b.queue:
                if self._try_send(conn, b.queue[0]) is _AGAIN:
                    break
                b.queue.popleft()
                if conn in self._dead:
                    break
            if conn in self._dead:
                continue
            if not b.queue:
                del self._blocked[conn]
                for st in self._by_rid.values():
                    if st.conn == conn and (st.pending or st.pending_text) and st.stream:
                        self._dirty[st.rid] = st
            elif now - b.since > CLIENT_STALL_S:
                self._mark_dead(conn)

    def _mark_dead(self, conn: Conn) -> None:
        self._dead.add(conn)
        self._blocked.pop(conn, None)
        self._batched.pop(conn, None)
        self.counters.dropped_clients += 1

    def take_dead(self) -> list[int]:
        """Forget dead connections; return the request ids they had in flight."""
        if not self._dead:
            return []
        dead = self._dead
        self._dead = set()
        rids = [st.rid for st in self._by_rid.values() if st.conn in dead]
        for rid in rids:
            self._close(self._by_rid[rid])
        return rids

    def fail_all(self, code: int, reason: str, message: str, retry_after_ms: int | None = None) -> None:
        """Last resort (the core is unusable): every open request gets an error event."""
        for rid in list(self._by_rid):
            self.fail(rid, code, reason, message, retryable=True, retry_after_ms=retry_after_ms)


@dataclass
class _Blocked:
    since: float
    queue: collections.deque


_AGAIN = object()


def _timing(timing: dict) -> dict:
    t = dict(timing)
    for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
        t.setdefault(k, None)
    return t
