"""Property: whatever backends do (tokens, done, errors, deaths, hangs, lost sends) and whatever clients do
(cancel, vanish), every request gets at most one terminal action, no tokens after it, and exactly one once
the backends are healthy again."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.balancer.actions import EmitTokens, FailRequest, FinishRequest, SendUpstream
from engine.balancer.backend_state import BackendSpec
from engine.balancer.core import BalancerCore, CoreConfig
from ipc.schema import validate_request

NAMES = ("tcp://a:1", "tcp://b:1", "tcp://c:1")
OPS = st.sampled_from(["submit", "tokens", "done", "error", "disconnect", "send_failed", "tick", "cancel", "gone",
                       "beat", "drain"])


class Harness:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.core = BalancerCore(CoreConfig(max_retries=2, max_migrations=2), [BackendSpec(n) for n in NAMES], 0.0,
                                 random.Random(seed))
        self.core.take_setup_actions()
        self.now = 0.0
        self.attempts: dict[str, tuple[str, int]] = {}  # live upstream generate ids
        self.health: list[tuple[str, str]] = []
        self.terminal: dict[int, int] = {}
        self.gone: set[int] = set()
        self.next_rid = 0

    def apply(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, SendUpstream):
                op, uid = a.msg["op"], a.msg["id"]
                if op == "generate":
                    self.attempts[uid] = (a.backend, 0)
                elif op == "health":
                    self.health.append((a.backend, uid))
            elif isinstance(a, (FinishRequest, FailRequest)):
                assert a.request_id not in self.gone, "a vanished client's request got a terminal event"
                self.terminal[a.request_id] = self.terminal.get(a.request_id, 0) + 1
                assert self.terminal[a.request_id] == 1, f"second terminal action for {a.request_id}"
            elif isinstance(a, EmitTokens):
                assert a.request_id not in self.terminal, "tokens after the terminal action"

    def beat(self, only=None) -> None:
        hs, self.health = self.health, []
        for backend, uid in hs:
            if only is None or backend in only:
                self.apply(self.core.on_event(backend, {"v": 1, "ev": "health", "id": uid, "ok": True,
                                                        "accepting": True, "chips_up": 1, "active_requests": 0}, self.now))

    def step(self, op: str) -> None:
        c, r = self.core, self.rng
        live = sorted(self.attempts)
        if op == "submit":
            self.next_rid += 1
            msg = validate_request({"v": 1, "op": "generate", "id": "x", "prompt": [1, 2, 3, r.randrange(9)],
                                    "max_tokens": 8})
            self.apply(c.submit(self.next_rid, msg, self.now))
        elif op in ("tokens", "done", "error") and live:
            uid = r.choice(live)
            backend, _ = self.attempts[uid]
            if op == "tokens":
                ev = {"v": 1, "ev": "tokens", "id": uid, "tokens": [r.randrange(5)]}
            elif op == "done":
                del self.attempts[uid]
                ev = {"v": 1, "ev": "done", "id": uid, "finish_reason": "length",
                      "usage": {"prompt_tokens": 4, "completion_tokens": 1, "cached_tokens": 0},
                      "timing": {"ttft_ms": 1.0, "tpot_ms": None, "e2e_ms": 1.0}}
            else:
                del self.attempts[uid]
                code = r.choice([429, 503, 500, 400])
                ev = {"v": 1, "ev": "error", "id": uid, "code": code, "reason": "x", "message": "m",
                      "retryable": code != 400}
            self.apply(c.on_event(backend, ev, self.now))
        elif op == "disconnect":
            name = r.choice(NAMES)
            self.attempts = {u: v for u, v in self.attempts.items() if v[0] != name}
            self.apply(c.on_disconnect(name, self.now))
        elif op == "send_failed" and live:
            uid = r.choice(live)
            backend, _ = self.attempts.pop(uid)
            self.apply(c.on_send_failed(backend, {"op": "generate", "id": uid}, self.now))
        elif op == "tick":
            self.now += r.choice([0.01, 0.3, 1.1, 3.5])
            self.apply(c.tick(self.now))
        elif op == "cancel" and self.next_rid:
            self.apply(c.cancel(r.randrange(1, self.next_rid + 1), self.now))
        elif op == "gone" and self.next_rid:
            rid = r.randrange(1, self.next_rid + 1)
            if rid not in self.terminal:
                self.gone.add(rid)
                self.apply(c.client_gone([rid], self.now))
        elif op == "beat":
            self.beat(only=set(r.sample(NAMES, r.randrange(1, 4))))
        elif op == "drain":
            c.set_drained(r.choice(NAMES), r.random() < 0.5)

    def settle(self) -> None:
        """Backends healthy and answering: everything still open must end."""
        for n in NAMES:
            self.core.set_drained(n, False)
        for _ in range(200):
            if set(self.terminal) | self.gone >= set(range(1, self.next_rid + 1)):
                return
            self.now += 0.5
            self.apply(self.core.tick(self.now))
            self.beat()
            for uid in sorted(self.attempts):
                self.step_done(uid)
        raise AssertionError(f"requests never ended: {set(range(1, self.next_rid + 1)) - set(self.terminal)}")

    def step_done(self, uid: str) -> None:
        backend, _ = self.attempts.pop(uid)
        self.apply(self.core.on_event(backend, {"v": 1, "ev": "done", "id": uid, "finish_reason": "length",
                                                "usage": {"prompt_tokens": 4, "completion_tokens": 1,
                                                          "cached_tokens": 0},
                                                "timing": {"ttft_ms": 1.0, "tpot_ms": None, "e2e_ms": 1.0}},
                                      self.now))


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ops=st.lists(OPS, min_size=1, max_size=80))
def test_every_request_ends_exactly_once_whatever_happens(seed, ops):
    h = Harness(seed)
    h.apply(h.core.tick(0.0))
    h.beat()
    for op in ops:
        h.step(op)
    h.settle()
    assert h.core.active() == 0
    assert all(not b.inflight for b in h.core.backends.values())
