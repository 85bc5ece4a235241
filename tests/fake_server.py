"""A scripted protocol server for client-side tests, and the events it answers with.

`FakeServer` is a real ZeroMQ ROUTER in a thread whose answers a test writes,
so a client test controls exactly what the server says and when.
"""

from __future__ import annotations

from engine import errors as _errors


class FakeServer:
    """A scripted ROUTER in a thread: `handler(msg) -> list of events` answers each request.

    Lets client tests control exactly what the server says and when, and
    records every request the client sent (cancels included). It plays a
    server older than `hello`: a connection's `hello` is kept apart in
    `hellos` and answered `400 unknown_op`, as such a server does.
    """

    def __init__(self, handler, batch: bool = False) -> None:
        import threading

        import zmq

        self.handler = handler
        self.batch = batch  # send each answer's events as the frames of one message, whether asked or not
        self.received: list[dict] = []
        self.hellos: list[dict] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import orjson

        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            ident, data = self._sock.recv_multipart()
            try:
                msg = orjson.loads(data)
            except orjson.JSONDecodeError:
                msg = None  # the handler answers what is not JSON
            if isinstance(msg, dict) and msg.get("op") == "hello":
                self.hellos.append(msg)
                self._sock.send_multipart([ident, orjson.dumps(
                    {"v": 1, "ev": "error", "id": msg.get("id"), "code": 400, "reason": "unknown_op",
                     "message": "op: unknown op 'hello'", "retryable": False})])
                continue
            self.received.append(msg)
            frames = [ev if isinstance(ev, bytes) else orjson.dumps(ev) for ev in self.handler(msg) or []]
            if self.batch and frames:
                self._sock.send_multipart([ident, *frames])
            else:
                for f in frames:
                    self._sock.send_multipart([ident, f])

    def cancels(self) -> list[str]:
        return [m["id"] for m in list(self.received) if m.get("op") == "cancel"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def done_ev(rid: str, tokens: list[int] | None = None, reason: str = "length") -> dict:
    ev = {"v": 1, "ev": "done", "id": rid, "finish_reason": reason,
          "usage": {"prompt_tokens": 1, "completion_tokens": len(tokens or []), "cached_tokens": 0},
          "timing": {"ttft_ms": 1.0, "tpot_ms": 1.0, "e2e_ms": 2.0}}
    if tokens is not None:
        ev["tokens"] = tokens
    return ev


def tokens_ev(rid: str, tokens: list[int]) -> dict:
    return {"v": 1, "ev": "tokens", "id": rid, "tokens": tokens}


def error_ev(rid: str, code: int, reason: str = "x", retryable: bool = False) -> dict:
    return {"v": 1, "ev": "error", "id": rid, "code": code, "reason": reason, "message": "m", "retryable": retryable}


CODES = [(400, _errors.InvalidRequest), (401, _errors.Unauthorized), (403, _errors.Forbidden),
         (404, _errors.ModelNotFound), (429, _errors.Overloaded), (500, _errors.ServerError),
         (501, _errors.NotSupported), (503, _errors.Unavailable), (504, _errors.DeadlineExceeded),
         (418, _errors.InvalidRequest), (502, _errors.ServerError)]


def echo_server(msg):
    """Answer generate with tokens derived from the prompt; health/stats with a body."""
    rid = msg["id"]
    if msg["op"] == "generate":
        toks = [t + 1 for t in msg["prompt"]]
        if msg["stream"]:
            return [tokens_ev(rid, toks[:1]), tokens_ev(rid, toks[1:]), done_ev(rid)]
        return [done_ev(rid, toks)]
    if msg["op"] in ("health", "stats"):
        return [{"v": 1, "ev": msg["op"], "id": rid, "ok": True}]
    return []
