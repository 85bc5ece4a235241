"""A raw protocol connection: one DEALER, every message read whole, every frame checked as an event.

The suite must see what a server really sends, so it never reads frame by
frame (`recv()` would hide how events are grouped): `recv_multipart()` gives
the whole message, and a message of several frames on a connection that was
not granted `batched_events` by `hello` is recorded as a violation of the v1
rule (one event per message). Frames that are not JSON objects with `v: 1`,
a string `ev` and an `id` are recorded too; the rest of the suite only ever
sees well-formed events.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import orjson
import zmq

TERMINAL_GENERATE = ("done", "error")


class WireTimeout(Exception):
    """The endpoint did not send what was awaited in time."""


@dataclass
class CurveKeys:
    """Client-side CURVE keys for a tcp:// endpoint that demands them (z85 bytes)."""

    public: bytes
    secret: bytes
    server_public: bytes


def load_curve_keys(secret_file: str, server_public_file: str) -> CurveKeys:
    """Keys from the files `npuserve keygen` writes (a `.key_secret` and the server's `.key`)."""
    import zmq.auth

    public, secret = zmq.auth.load_certificate(secret_file)
    if not secret:
        raise ValueError(f"{secret_file} holds no secret key (give the .key_secret file)")
    server_public, _ = zmq.auth.load_certificate(server_public_file)
    return CurveKeys(public, secret, server_public)


@dataclass
class Connection:
    """One client connection; ids are scoped to it (protocol.md, "Wire behaviour decided here")."""

    sock: zmq.Socket
    endpoint: str
    timeout_s: float
    batched: bool = False  # `batched_events` granted by a `hello` reply
    messages: int = 0
    multi_frame_messages: int = 0
    violations: list[str] = field(default_factory=list)
    inbox: list[dict] = field(default_factory=list)  # events read but not yet taken by `take`

    def send(self, msg: dict | bytes) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else orjson.dumps(msg))

    def recv_message(self, timeout_s: float | None = None) -> list[dict]:
        """The events of the next message (one, unless batching was granted); WireTimeout if none comes."""
        wait_ms = int(1000 * (self.timeout_s if timeout_s is None else timeout_s))
        if not self.sock.poll(wait_ms):
            raise WireTimeout(f"no message from {self.endpoint} within {wait_ms / 1000:.1f} s")
        frames = self.sock.recv_multipart()
        self.messages += 1
        if len(frames) > 1:
            self.multi_frame_messages += 1
            if not self.batched:
                self.violations.append(f"a message of {len(frames)} frames on a connection that did not opt in "
                                       "with hello/batched_events (v1: exactly one event per message)")
        events = []
        for data in frames:
            ev = self._event(data)
            if ev is not None:
                events.append(ev)
        return events

    def _event(self, data: bytes) -> dict | None:
        try:
            ev = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.violations.append(f"a frame that is not JSON: {data[:80]!r}")
            return None
        if not isinstance(ev, dict):
            self.violations.append(f"a frame that is not a JSON object: {data[:80]!r}")
            return None
        if ev.get("v") != 1 or type(ev.get("v")) is not int:
            self.violations.append(f"an event without \"v\": 1: {data[:120]!r}")
        if not isinstance(ev.get("ev"), str):
            self.violations.append(f"an event without a string \"ev\": {data[:120]!r}")
            return None
        if "id" not in ev:
            self.violations.append(f"an event without \"id\": {data[:120]!r}")
        return ev

    def next_event(self, timeout_s: float | None = None) -> dict:
        """The next event, whatever message it came in."""
        while not self.inbox:
            self.inbox.extend(self.recv_message(timeout_s))
        return self.inbox.pop(0)

    def request(self, msg: dict | bytes, timeout_s: float | None = None) -> dict:
        """Send one message and return the next event (for ops answered by one event, on a quiet connection)."""
        self.send(msg)
        return self.next_event(timeout_s)

    def collect(self, ids, timeout_s: float | None = None, terminal=TERMINAL_GENERATE) -> dict[str, list[dict]]:
        """Every event of `ids` until each has a terminal event; events of other ids are kept under theirs."""
        want = set(ids)
        got: dict[str, list[dict]] = defaultdict(list)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while any(not any(e["ev"] in terminal for e in got[i]) for i in want):
            left = deadline - time.monotonic()
            if left <= 0:
                open_ = sorted(i for i in want if not any(e["ev"] in terminal for e in got[i]))
                raise WireTimeout(f"{len(open_)} request(s) without a terminal event after "
                                  f"{self.timeout_s if timeout_s is None else timeout_s:.0f} s: {open_[:5]}")
            ev = self.next_event(left)
            got[str(ev.get("id"))].append(ev)
        return dict(got)

    def quiet(self, settle_s: float) -> list[dict]:
        """Events that arrive within `settle_s` (expected: none); used after a request's terminal event."""
        out = list(self.inbox)
        self.inbox.clear()
        deadline = time.monotonic() + settle_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                out.extend(self.recv_message(left))
            except WireTimeout:
                break
        return out

    def close(self) -> None:
        self.sock.close(0)


def open_connection(ctx: zmq.Context, endpoint: str, timeout_s: float, curve: CurveKeys | None = None) -> Connection:
    """A DEALER with no high-water marks (every event of every request is kept) and LINGER 0."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve.public, curve.secret, \
            curve.server_public
    sock.connect(endpoint)
    return Connection(sock, endpoint, timeout_s)
