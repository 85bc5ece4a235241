"""One DEALER per backend, with a monitor socket that reports connects and disconnects.

IMMEDIATE: a send to a backend with no live connection fails at once (EAGAIN)
instead of queueing for a peer that may never come back, which is how the
core hears that a backend is gone before its heartbeats run out. No
high-water marks: every in-flight stream's events must be kept. Each new
connection opens with `hello` asking for batched events (a backend's token
events of one loop turn in one message); a backend older than `hello` answers
it with an error the core ignores, and sends one event per message.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.client import build_hello
from engine.daemon.curve import CurveClientKeys
from ipc.codec import encode

_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class UpstreamLink:
    def __init__(self, ctx: zmq.Context, name: str, endpoint: str, curve: CurveClientKeys | None = None) -> None:
        self.name = name
        self.sock = ctx.socket(zmq.DEALER)
        s = self.sock
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if curve is not None:
            s.curve_publickey = curve.public
            s.curve_secretkey = curve.secret
            s.curve_serverkey = curve.server_public
        self.monitor = s.get_monitor_socket(_MONITORED)
        s.connect(endpoint)

    def send(self, msg: dict) -> bool:
        """False when there is no connection to send on."""
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def recv_all(self, limit: int = 512) -> list[bytes]:
        """Every waiting message (up to `limit`); asks ZMQ_EVENTS rather than paying for a zmq.Again each turn."""
        out: list[bytes] = []
        sock = self.sock
        while len(out) < limit and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            out.append(sock.recv(zmq.NOBLOCK))
        return out

    def monitor_events(self) -> list[int]:
        """Connection events since the last call (zmq.EVENT_* values); a new connection is sent `hello` first."""
        out: list[int] = []
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return out
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.send(build_hello())
            out.append(event)

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)
        self.sock.close(0)
