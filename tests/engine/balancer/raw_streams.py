"""Drive many generate requests over one raw DEALER and keep every event (to count terminal events)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import zmq

from engine.client import open_dealer
from ipc.codec import decode_event, encode

TERMINAL = ("done", "error")


def gen_msg(rid: str, prompt: list[int], **fields) -> dict:
    return {"v": 1, "op": "generate", "id": rid, "prompt": prompt, **fields}


def run_streams(endpoint: str, msgs: list[dict], *, timeout: float = 120.0, grace: float = 0.5,
                on_progress: Callable[[dict, zmq.Socket], None] | None = None,
                setup: Callable[[zmq.Socket], None] | None = None) -> dict[str, list[dict]]:
    """Send every message, return {id: [events]} once all ended and `grace` passed without a new event."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER) if setup else open_dealer(ctx, endpoint, batched_events=False)
    if setup:
        sock.setsockopt(zmq.LINGER, 0)
        setup(sock)
        sock.connect(endpoint)
    try:
        for m in msgs:
            sock.send(encode(m))
        events: dict[str, list[dict]] = defaultdict(list)
        ids = {m["id"] for m in msgs if m["op"] == "generate"}
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while time.monotonic() < deadline:
            if sock.poll(20):
                while True:
                    try:
                        ev = decode_event(sock.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    events[ev["id"]].append(ev)
                    last = time.monotonic()
            if on_progress is not None:
                on_progress(events, sock)
            ended = all(any(e["ev"] in TERMINAL for e in events.get(i, ())) for i in ids)
            if ended and time.monotonic() - last > grace:
                return dict(events)
        raise AssertionError(f"not every request ended within {timeout} s: "
                             f"{ {i: [e['ev'] for e in events.get(i, [])][-3:] for i in ids} }")
    finally:
        sock.close(0)


def streamed_tokens(evs: list[dict]) -> list[int]:
    out: list[int] = []
    for e in evs:
        if e["ev"] in ("tokens", "done"):
            out += e.get("tokens") or []
    return out


def terminal_events(evs: list[dict]) -> list[dict]:
    return [e for e in evs if e["ev"] in TERMINAL]
