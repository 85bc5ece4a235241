"""What a check runs with: the options, the endpoint's facts, fresh connections and unique ids."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import zmq

from tools.conformance.target import Target
from tools.conformance.wire import Connection, CurveKeys, open_connection


@dataclass
class Options:
    endpoint: str
    timeout_s: float = 60.0  # per awaited reply or stream: a hang guard, not a performance bound
    admin: bool = False  # the endpoint grants admin ops to this client: check drain/resume (and 503 draining)
    admin_denied: bool = False  # the endpoint denies admin ops to this client: check 403 forbidden
    overload: int = 0  # burst size that must overflow the endpoint's waiting room (429); 0 = skip
    second_model: str | None = None  # another alias the endpoint serves
    package: str | None = None  # a package inside the endpoint's model root, loaded and unloaded (needs admin)
    max_message_bytes: int = 1 << 20  # the endpoint's server.max_message_bytes (for too_large)
    crowd: int = 24  # concurrent requests around the seeded one
    kind: str = "auto"  # daemon | balancer | auto (from health)
    settle_s: float = 0.1  # after each check, how long to watch its connections for stray events
    curve: CurveKeys | None = None
    only: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()


@dataclass
class Env:
    opts: Options
    target: Target
    ctx: zmq.Context
    check: str = ""
    connections: list[Connection] = field(default_factory=list)
    _ids: itertools.count = field(default_factory=itertools.count)

    def conn(self) -> Connection:
        c = open_connection(self.ctx, self.opts.endpoint, self.opts.timeout_s, self.opts.curve)
        self.connections.append(c)
        return c

    def rid(self, tag: str = "") -> str:
        """A request id unique in this run (ids are 1-128 characters)."""
        return f"cf{os.getpid() % 10000}-{self.check}{'-' + tag if tag else ''}-{next(self._ids)}"[:128]

    @property
    def daemon(self) -> bool:
        return self.target.kind == "daemon"

    def close_all(self) -> None:
        for c in self.connections:
            c.close()
        self.connections.clear()


def gen(rid: str, prompt: list[int] | None = None, **fields) -> dict:
    """A generate request with `v`, `op`, `id` first (protocol.md: an oversized message is answered by them)."""
    msg = {"v": 1, "op": "generate", "id": rid}
    if prompt is not None:
        msg["prompt"] = prompt
    msg.update(fields)
    return msg


def op(name: str, rid: str, **fields) -> dict:
    return {"v": 1, "op": name, "id": rid, **fields}
