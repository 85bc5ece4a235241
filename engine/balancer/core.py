"""The balancer core: routing, backend health, retries and stream migration, sans I/O.

The shell feeds it what happened (a client request, an upstream event, a
disconnect, a failed send, the passage of time) with a `now`, and carries out
the actions it returns (`engine.balancer.actions`). It keeps no state a
restart would need: requests in flight are the only state, and a restarted
balancer simply starts without them.

A request's attempts each get a fresh upstream id, so a late event of an
abandoned attempt names nothing and is dropped. Before its first token a
failed attempt (429, 503, a retryable 500, a dead backend) is retried on
another backend with exponential backoff and jitter, within `max_retries`
and the request's deadline. After its first token a broken stream is
migrated: the prompt plus every token already streamed go to a healthy
backend as a `continuation`, so the client sees one stream; seeded sampling
is keyed by (seed, position), so the result equals an uninterrupted run.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from engine.balancer.actions import (CloseBackend, EmitTokens, FailRequest, FinishRequest, OpenBackend, Reply,
                                     SendUpstream)
from engine.balancer.backend_state import Backend, BackendSpec, Health, HealthPolicy
from engine.balancer.pd_routing import (Stage, choose_decode, continues_after_prefill, decode_msg, first_stage,
                                        for_stage, pd_enabled, prefill_msg, shows_first_token)
from engine.balancer.choices import ChoiceGroups
from engine.balancer.model_match import known_adapters, matching, not_served
from engine.balancer.prefix_index import PrefixIndex, block_hashes, text_block_hashes
from engine.balancer.routing import RoutingPolicy, choose, imbalanced
from engine.balancer.stats_merge import merge_stats
from engine.core.retry_after import NOT_READY_RETRY_S, RETRY_AFTER_MAX_S, clamp_ms, until_ms

PROTOCOL_VERSION = 1
RETRY_CODES = (429, 503)
MIGRATE_CODES = (500, 503)
NO_BACKEND_POLL_S = 0.05  # how often a request waiting for a routable backend looks again
CHARS_PER_TOKEN = 4  # a text prompt's prefix chunk spans about one KV block: block_size tokens of ~4 characters


@dataclass(frozen=True)
class CoreConfig:
    health: HealthPolicy = field(default_factory=HealthPolicy)
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    max_retries: int = 3  # re-sends of a request that has not streamed yet
    migrate: bool = True
    max_migrations: int = 3
    backoff_base_s: float = 0.02
    backoff_max_s: float = 1.0
    no_backend_wait_s: float = 5.0  # a request without a deadline waits this long for a routable backend
    fanout_timeout_s: float = 2.0  # stats/models: how long to wait for the backends' replies
    pools: tuple[tuple[str, int], ...] = ()  # (pool, min_priority): a request goes to the highest it reaches
    prefix_capacity_blocks: int = 65536


class ReqState(enum.Enum):
    PENDING = "pending"  # waiting for a backend or a retry time
    SENT = "sent"  # an attempt is upstream, no token yet
    STREAMING = "streaming"  # at least one token reached the client


@dataclass(eq=False)
class BRequest:
    rid: int
    msg: dict
    arrival: float
    deadline: float | None
    pool: str | None
    hashes: list[int]
    state: ReqState = ReqState.PENDING
    backend: str | None = None
    uid: str | None = None
    streamed: list[int] = field(default_factory=list)
    retries: int = 0
    migrations: int = 0
    tried: set[str] = field(default_factory=set)
    retry_at: float | None = None
    waiting_since: float | None = None
    cancelling: bool = False
    t_first: float | None = None
    t_last: float | None = None
    cached_tokens: int = 0
    prompt_tokens: int | None = None  # the backend's count, for text prompts (tokenized there)
    last_error: tuple[int, str, str] = (503, "no_backend", "no backend available")
    last_retry_after_ms: int | None = None  # the retry_after_ms of the backend error that is `last_error`
    stage: Stage = Stage.WHOLE  # prefill/decode disaggregation: which leg is upstream
    handoff: dict | None = None  # the prefill leg's hand-off descriptor, for the decode leg
    hidden: list[EmitTokens] = field(default_factory=list)  # a prefill leg's output not shown (stop sequences)
    prefilled: bool = False  # a prefill leg handed off: its usage (cached_tokens) is the request's
    leg_start: int = 0  # len(streamed) when the current leg was sent (its backend counts only what follows)
    unsent: int = 0  # tokens the last leg generated but did not send (an EOS or stop id): usage counts them


@dataclass(eq=False)
class Fanout:
    token: Any
    op: str
    deadline: float
    pending: dict[str, str]  # upstream id -> backend
    results: dict[str, dict] = field(default_factory=dict)


class BalancerCore:
    def __init__(self, config: CoreConfig, backends: list[BackendSpec], now: float,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.rng = rng or random.Random()
        self.backends: dict[str, Backend] = {}
        self.index = PrefixIndex(config.prefix_capacity_blocks)
        self.choices = ChoiceGroups()  # requests with n > 1 (engine/balancer/choices.py)
        self.accepting = True
        self.drain_deadline: float | None = None  # admin drain with timeout_ms: live requests end then
        self.started_at = now
        self.counters: Counter[str] = Counter()
        self.routed: Counter[str] = Counter()
        self._reqs: dict[int, BRequest] = {}
        self._by_uid: dict[str, int] = {}
        self._heartbeats: dict[str, str] = {}  # upstream id -> backend
        self._fanouts: dict[str, Fanout] = {}  # fanout upstream id -> fanout
        self._timers: list[tuple[float, int, int]] = []  # (time, seq, rid)
        self._seq = itertools.count(1)
        self._uids = itertools.count(1)
        self.pd = False  # prefill and decode backends both configured: requests run in two legs
        self._pending_actions: list = self.set_backends(backends, now)

    # ------------------------------------------------------------------ backends
    def set_backends(self, specs: list[BackendSpec], now: float) -> list:
        """(Re)load the backend list: new ones are opened, gone ones stop getting requests and close when idle."""
        out: list = []
        wanted = {s.endpoint: s for s in specs}
        assert len(wanted) == len(specs), "duplicate backend endpoint"
        for name, spec in wanted.items():
            b = self.backends.get(name)
            if b is None:
                self.backends[name] = Backend(spec, next_heartbeat=now)
                out.append(OpenBackend(name))
            else:
                b.spec = spec
                b.removed = False
        for name, b in self.backends.items():
            if name not in wanted and not b.removed:
                b.removed = True
                self.index.forget(name)
        self.pd = pd_enabled(list(self.backends.values()))
        return out + self._close_idle_removed()

    def take_setup_actions(self) -> list:
        """Actions produced outside a call that returns them (the constructor's OpenBackend)."""
        out, self._pending_actions = self._pending_actions, []
        return out

    def _close_idle_removed(self) -> list:
        out = []
        for name in [n for n, b in self.backends.items() if b.removed and not b.inflight]:
            del self.backends[name]
            for uid in [u for u, bn in self._heartbeats.items() if bn == name]:
                del self._heartbeats[uid]
            out.append(CloseBackend(name))
        return out

    def drain(self, now: float, timeout_s: float | None) -> None:
        """Admin drain: no new requests; in-flight ones finish, or end `timeout_s` from now (None: no limit)."""
        self.accepting = False
        self.drain_deadline = None if timeout_s is None else now + timeout_s

    def resume(self) -> None:
        self.accepting = True
        self.drain_deadline = None

    def _drain_timed_out(self) -> list:
        """The drain's time is up: what is still in flight ends like at shutdown (503, retryable)."""
        self.drain_deadline = None
        self.counters["drain_timed_out"] += len(self._reqs)
        return self._end_live("the balancer's drain timed out")

    def _end_live(self, message: str) -> list:
        """Every live request ends (503 shutdown, retryable) and its attempt is cancelled upstream."""
        out: list = []
        for r in list(self._reqs.values()):
            if r.state is not ReqState.PENDING:
                out.append(SendUpstream(r.backend, _cancel_msg(r.uid)))
            out.append(FailRequest(r.rid, 503, "shutdown", message, True, retry_after_ms=clamp_ms(NOT_READY_RETRY_S)))
            self._drop(r)
        return out

    def set_drained(self, name: str, drained: bool) -> bool:
        b = self.backends.get(name)
        if b is None or b.removed:
            return False
        b.drained = drained
        return True

    # ------------------------------------------------------------------ requests
    def submit(self, rid: int, msg: dict, now: float) -> list:
        """A validated `generate` from a client (its `tenant` already set by the shell's authentication)."""
        assert rid not in self._reqs
        self.counters["requests"] += 1
        if not self.accepting:
            self.counters["rejected_draining"] += 1
            return [FailRequest(rid, 503, "draining", "the balancer is draining; retry elsewhere", True,
                                retry_after_ms=until_ms(now, self.drain_deadline))]
        dl = msg.get("deadline_ms")
        pool = msg.get("pool") or self._pool_for(msg["priority"])
        r = BRequest(rid, msg, now, None if dl is None else now + dl / 1000.0, pool, self._hashes(msg))
        r.stage = first_stage(msg, 0, self.pd, self.config.routing.pd_min_prompt_tokens) \
            if msg.get("n", 1) == 1 else Stage.WHOLE  # choices: one board
        self._reqs[rid] = r
        return self._dispatch(r, now)

    def _hashes(self, msg: dict) -> list[int]:
        """The prefix index keys of a prompt: token blocks, or fixed-size character chunks of a text prompt."""
        bs = self.config.routing.block_size
        if msg.get("prompt") is not None:
            return block_hashes(msg["prompt"], bs)
        return text_block_hashes(msg["text"], bs * CHARS_PER_TOKEN)

    def cancel(self, rid: int, now: float) -> list:
        r = self._reqs.get(rid)
        if r is None:
            return []
        self.counters["cancels"] += 1
        if r.state is ReqState.PENDING:
            return self._finish(r, "cancelled", now)
        r.cancelling = True
        return [SendUpstream(r.backend, _cancel_msg(r.uid))]

    def client_gone(self, rids: list[int], now: float) -> list:
        """The client vanished: cancel upstream and forget (its events have nowhere to go)."""
        out: list = []
        for rid in rids:
            r = self._reqs.get(self.choices.leader(rid))
            if r is None:
                continue
            self.choices.forget(r.rid)
            self.counters["cancelled_dead_clients"] += 1
            if r.state is not ReqState.PENDING:
                out.append(SendUpstream(r.backend, _cancel_msg(r.uid)))
            self._drop(r)
        return out

    def shutdown(self, now: float) -> list:
        """Admission closes; every live request ends (503 shutdown, retryable), cancelled upstream."""
        self.accepting = False
        return self._end_live("the balancer is shutting down")

    def active(self) -> int:
        return len(self._reqs)

    # ------------------------------------------------------------------ upstream events
    def on_event(self, backend: str, ev: dict, now: float) -> list:
        uid = ev.get("id")
        b = self.backends.get(backend)
        if b is None or uid is None:
            return []
        rid = self._by_uid.get(uid)
        if rid is not None:
            return self._on_stream_event(b, self._reqs[rid], ev, now)
        if uid in self._heartbeats:
            del self._heartbeats[uid]
            if ev["ev"] == "health":
                self.counters["heartbeats_ok"] += 1
                was = b.health
                b.on_heartbeat(_body(ev), now, self.config.health)
                if b.health is not was and b.health is Health.HALF_OPEN:
                    self.counters["half_open"] += 1
            return []
        fo = self._fanouts.get(uid)
        if fo is not None:
            del self._fanouts[uid]
            name = fo.pending.pop(uid)
            fo.results[name] = _body(ev) if ev["ev"] != "error" else {"error": ev.get("message", "")}
            if not fo.pending:
                return [self._complete_fanout(fo, now)]
            return []
        return []  # an abandoned attempt or an old reply

    def _on_stream_event(self, b: Backend, r: BRequest, ev: dict, now: float) -> list:
        kind = ev["ev"]
        if "index" in ev:
            choice = self.choices.on_event(r.rid, ev)
            if choice is not None:
                out, ended = choice
                if r.state is ReqState.SENT:
                    r.state = ReqState.STREAMING
                    b.on_success()
                if ended:
                    self.counters["finished_choices"] += 1
                    self._drop(r)
                return out
        if kind == "tokens":
            toks = ev["tokens"]
            if "prompt_logprobs" in ev and r.msg.get("max_tokens"):  # relayed once: a resumed leg does not ask
                r.msg = {k: v for k, v in r.msg.items() if k != "prompt_logprobs"}
            if r.stage is Stage.PREFILL and not shows_first_token(r.msg):
                r.hidden.append(EmitTokens(r.rid, toks, ev.get("logprobs"), ev.get("text"),
                               ev.get("top_logprobs"), ev.get("prompt_logprobs")))
                return []
            if r.t_first is None:
                r.t_first = now
            r.t_last = now
            r.streamed.extend(toks)
            if r.state is ReqState.SENT:
                r.state = ReqState.STREAMING
                b.on_success()
            return [EmitTokens(r.rid, toks, ev.get("logprobs"), ev.get("text"),
                               ev.get("top_logprobs"), ev.get("prompt_logprobs"))]
        uid = r.uid
        self._detach(r)
        if kind == "done" and r.stage is Stage.PREFILL:
            b.on_success()
            return self._prefill_done(r, b, uid, ev, now)
        if kind == "done":
            b.on_success()
            if ev.get("tokens"):  # a backend that answered non-streamed (not what we ask, but legal)
                r.streamed.extend(ev["tokens"])
                out: list = [EmitTokens(r.rid, ev["tokens"], ev.get("logprobs"), ev.get("text"),
                               ev.get("top_logprobs"), ev.get("prompt_logprobs"))]
            else:
                out = []
            usage = ev.get("usage") or {}
            if not r.prefilled:  # the prompt was computed (and counted) at the prefill leg
                r.cached_tokens = int(usage.get("cached_tokens", 0) or 0)
                r.prompt_tokens = usage.get("prompt_tokens")
            _count_unsent(r, ev["finish_reason"], usage)
            return out + self._finish(r, ev["finish_reason"], now)
        assert kind == "error", kind
        code, reason, message = ev["code"], ev["reason"], ev["message"]
        retryable = bool(ev.get("retryable"))
        r.last_error = (code, reason, message)
        retry_after = ev.get("retry_after_ms")
        r.last_retry_after_ms = retry_after if retryable and type(retry_after) is int and retry_after >= 0 else None
        if code >= 500 and code not in (501, 504) and reason not in ("shutdown", "draining"):
            self._breaker_failure(b, f"{code} {reason}", now)
        if r.cancelling:
            return self._finish(r, "cancelled", now)
        if not r.streamed and (code in RETRY_CODES or (code == 500 and retryable)):
            return self._retry(r, now, immediate=False)
        if r.stage is Stage.DECODE and code == 429:  # a decode board that is full now: another, after a backoff
            return self._retry(r, now, immediate=False)
        if r.streamed and retryable and code in MIGRATE_CODES:
            return self._migrate(r, now)
        self._drop(r)
        return [FailRequest(r.rid, code, reason, message, retryable, retry_after_ms=r.last_retry_after_ms)]

    def on_disconnect(self, backend: str, now: float) -> list:
        b = self.backends.get(backend)
        if b is None or b.health is Health.UNKNOWN and not b.inflight:
            return []
        return self._backend_lost(b, "disconnected", now, cancel_upstream=False)

    def on_connect(self, backend: str, now: float) -> list:
        """A (re)connection: ask for a heartbeat at once rather than at the next interval."""
        b = self.backends.get(backend)
        if b is not None:
            b.next_heartbeat = now
        return []

    def on_send_failed(self, backend: str, msg: dict, now: float) -> list:
        """A send found no connection (the socket queues nothing for absent peers)."""
        b = self.backends.get(backend)
        self.counters["send_failures"] += 1
        uid = msg.get("id")
        if b is None:
            return []
        if msg.get("op") == "health":
            self._heartbeats.pop(uid, None)
            return []
        if msg.get("op") == "generate":
            return self._backend_lost(b, "not connected", now, cancel_upstream=False)
        fo = self._fanouts.pop(uid, None)
        if fo is not None:
            fo.results[fo.pending.pop(uid)] = {"error": "not connected"}
            if not fo.pending:
                return [self._complete_fanout(fo, now)]
        return []

    def _breaker_failure(self, b: Backend, why: str, now: float) -> None:
        if b.on_failure(why, now, self.config.health):
            self.counters["breaker_opened"] += 1

    def _backend_lost(self, b: Backend, why: str, now: float, cancel_upstream: bool) -> list:
        """The backend is gone or hung: out of routing, its requests retried or migrated elsewhere."""
        if b.health is not Health.OUT:
            b.open(why, now, self.config.health)
        self.counters["backend_lost"] += 1
        self.index.forget(b.name)
        out: list = []
        for rid in sorted(b.inflight):
            r = self._reqs[rid]
            if cancel_upstream:
                out.append(SendUpstream(b.name, _cancel_msg(r.uid)))
            self._detach(r)
            r.last_error = (503, "backend_lost", f"backend {b.name} {why}")
            r.last_retry_after_ms = None
            if r.cancelling:
                out += self._finish(r, "cancelled", now)
            elif self.choices.started(rid):  # not migrated: a choice's continuation would be another's
                out += self._fail(r, 503, "stream_broken", f"the stream broke ({r.last_error[2]}); a request "
                                  "with n > 1 is not migrated", True, self._retry_after_ms(r, now))
            elif r.streamed:
                out += self._migrate(r, now)
            else:
                out += self._retry(r, now, immediate=True)
        return out

    # ------------------------------------------------------------------ time
    def tick(self, now: float) -> list:
        out: list = []
        if self.drain_deadline is not None and now >= self.drain_deadline:
            out += self._drain_timed_out()
        pol = self.config.health
        for b in list(self.backends.values()):
            if b.check_heartbeat(now, pol):
                out += self._backend_lost(b, b.reason, now, cancel_upstream=True)
            if now >= b.next_heartbeat and not b.removed:
                uid = f"h{next(self._uids)}"
                self._heartbeats[uid] = b.name
                b.next_heartbeat = now + pol.heartbeat_interval_s
                self.counters["heartbeats_sent"] += 1
                out.append(SendUpstream(b.name, {"v": PROTOCOL_VERSION, "op": "health", "id": uid}))
        # bound the map of unanswered heartbeats (a hung backend never answers)
        if len(self._heartbeats) > 64 * max(1, len(self.backends)):
            for uid in list(self._heartbeats)[: len(self._heartbeats) // 2]:
                del self._heartbeats[uid]
        while self._timers and self._timers[0][0] <= now:
            _, _, rid = heapq.heappop(self._timers)
            r = self._reqs.get(rid)
            if r is not None and r.state is ReqState.PENDING and r.retry_at is not None and r.retry_at <= now:
                r.retry_at = None
                out += self._dispatch(r, now)
        for fo in {id(f): f for f in self._fanouts.values()}.values():
            if now >= fo.deadline:
                for uid, name in fo.pending.items():
                    fo.results[name] = {"error": "no reply in time"}
                    self._fanouts.pop(uid, None)
                fo.pending = {}
                out.append(self._complete_fanout(fo, now))
        out += self._close_idle_removed()
        return out

    def next_wakeup(self, now: float) -> float | None:
        pol = self.config.health
        times = [b.next_heartbeat for b in self.backends.values() if not b.removed]
        limit = pol.missed_heartbeats * pol.heartbeat_interval_s
        times += [b.last_reply + limit + 1e-3 for b in self.backends.values()
                  if b.last_reply is not None and b.health in (Health.UP, Health.HALF_OPEN)]
        if self._timers:
            times.append(self._timers[0][0])
        times += [f.deadline for f in self._fanouts.values()]
        if self.drain_deadline is not None:
            times.append(self.drain_deadline)
        return min(times) if times else None

    # ------------------------------------------------------------------ dispatch, retry, migrate
    def _pool_for(self, priority: int) -> str | None:
        best = None
        for pool, min_prio in self.config.pools:
            if priority >= min_prio and (best is None or min_prio > best[1]):
                best = (pool, min_prio)
        return None if best is None else best[0]

    def candidates(self, r: BRequest, now: float) -> list[Backend]:
        cands = [b for b in self.backends.values() if b.routable()]
        if self.pd:
            staged = for_stage(cands, r.stage, self.pd)
            if not staged and r.stage is Stage.PREFILL:  # no prefill board: the whole request, co-located
                self.counters["pd_whole_fallbacks"] += 1
                r.stage = Stage.WHOLE
                staged = for_stage(cands, r.stage, self.pd)
            cands = staged
        if r.msg.get("model") is not None or r.msg.get("adapter") is not None:
            cands = matching(cands, r.msg, [b for b in self.backends.values() if not b.removed])
        if r.pool is not None:
            cands = [b for b in cands if b.spec.pool == r.pool] or cands
        fresh = [b for b in cands if not b.stale(now, self.config.health)]
        cands = fresh or cands
        cands = [b for b in cands if b.name not in r.tried] or cands
        if not r.streamed:  # a recovering backend's one probe: a fresh request, retried elsewhere if it fails
            cands = [b for b in cands if b.health is Health.HALF_OPEN] or cands
        return cands

    def _dispatch(self, r: BRequest, now: float) -> list:
        cands = self.candidates(r, now)
        if not cands:
            missing = None if r.streamed else not_served(r.msg, [b for b in self.backends.values() if not b.removed])
            if missing is not None:
                return self._fail(r, 404, *missing)
            if r.waiting_since is None:
                r.waiting_since = now
            limit = r.deadline if r.deadline is not None else r.waiting_since + self.config.no_backend_wait_s
            if now >= limit:
                self.counters["no_backend"] += 1
                if r.deadline is not None and now >= r.deadline:
                    return self._fail(r, 504, "deadline_exceeded", "the deadline passed before a backend could serve it")
                code, reason, message = r.last_error
                return self._fail(r, 503, reason if code == 503 else "no_backend",
                                  f"no backend could take the request ({message})", True,
                                  self._backends_retry_ms(now))
            return self._wait(r, now + NO_BACKEND_POLL_S)
        r.waiting_since = None
        r.hidden = []  # a new attempt: what an abandoned prefill leg produced is gone
        rp = self.config.routing
        if self.pd and r.stage is Stage.DECODE:
            b = choose_decode(cands)
        else:
            ch = choose(cands, r.hashes, _prompt_len(r.msg), rp, self.index)
            if ch.policy_used is not rp.policy:
                self.counters["imbalance_fallbacks"] += 1
            b = ch.backend
        uid = f"g{next(self._uids)}"
        r.uid, r.backend = uid, b.name
        r.state = ReqState.STREAMING if r.streamed else ReqState.SENT
        r.leg_start = len(r.streamed)
        r.tried.add(b.name)
        b.inflight.add(r.rid)
        if b.health is Health.HALF_OPEN:
            b.probe = r.rid
            self.counters["probes"] += 1
        self._by_uid[uid] = r.rid
        self.index.record(b.name, r.hashes)
        self.routed[b.name] += 1
        self.counters["attempts"] += 1
        return [SendUpstream(b.name, self._upstream_msg(r, uid, now))]

    def _upstream_msg(self, r: BRequest, uid: str, now: float) -> dict:
        m = dict(r.msg)
        m["id"] = uid
        m["stream"] = True  # always streamed upstream, so a broken stream can be migrated
        if r.streamed:
            m["continuation"] = list(r.msg["continuation"]) + r.streamed
        if r.deadline is not None:
            m["deadline_ms"] = max(1, int((r.deadline - now) * 1000))
        if r.stage is Stage.PREFILL:
            return prefill_msg(m, list(r.msg["continuation"]) + r.streamed)
        if r.stage is Stage.DECODE:
            return decode_msg(m, r.handoff)
        return m

    def _wait(self, r: BRequest, at: float) -> list:
        r.state = ReqState.PENDING
        r.retry_at = at
        heapq.heappush(self._timers, (at, next(self._seq), r.rid))
        return []

    def _retry(self, r: BRequest, now: float, immediate: bool) -> list:
        if r.retries >= self.config.max_retries:
            code, reason, message = r.last_error
            self.counters["retries_exhausted"] += 1
            retryable = code in (429, 503)
            return self._fail(r, code, reason, f"{message} (after {r.retries} retries)", retryable,
                              self._retry_after_ms(r, now) if retryable else None)
        r.retries += 1
        self.counters["retries"] += 1
        if immediate:
            return self._dispatch(r, now)
        c = self.config
        delay = min(c.backoff_max_s, c.backoff_base_s * 2 ** (r.retries - 1)) * self.rng.uniform(0.5, 1.0)
        if r.deadline is not None and now + delay >= r.deadline:
            return self._fail(r, 504, "deadline_exceeded", "the deadline leaves no time for a retry")
        return self._wait(r, now + delay)

    def _migrate(self, r: BRequest, now: float) -> list:
        c = self.config
        if not c.migrate or r.migrations >= c.max_migrations:
            self.counters["migrations_exhausted"] += 1
            why = "migration is off" if not c.migrate else f"{r.migrations} migrations already"
            return self._fail(r, 503, "stream_broken", f"the stream broke ({r.last_error[2]}); {why}", True,
                              self._retry_after_ms(r, now))
        r.migrations += 1
        self.counters["migrations"] += 1
        if r.stage is Stage.PREFILL:  # the first token is out: the rest is a decode leg (which recomputes)
            r.stage = Stage.DECODE
        return self._dispatch(r, now)

    def _prefill_done(self, r: BRequest, b: Backend, uid: str | None, ev: dict, now: float) -> list:
        """The prefill leg ended: hand off to a decode board, or end the request when it is complete."""
        hidden, r.hidden = r.hidden, []
        if ev.get("tokens") and not hidden and shows_first_token(r.msg):  # answered non-streamed
            r.streamed.extend(ev["tokens"])
            out: list = [EmitTokens(r.rid, ev["tokens"], ev.get("logprobs"), ev.get("text"),
                               ev.get("top_logprobs"), ev.get("prompt_logprobs"))]
        else:
            out = []
        usage = ev.get("usage") or {}
        r.cached_tokens = int(usage.get("cached_tokens", 0) or 0)
        r.prompt_tokens = usage.get("prompt_tokens")
        reason = ev["finish_reason"]
        if r.cancelling or not continues_after_prefill(reason, r.msg, len(r.streamed)):
            for e in hidden:  # the request ends here: what the prefill leg produced is its output
                r.streamed.extend(e.tokens)
            _count_unsent(r, reason, usage)
            if (hidden or out) and r.t_first is None:
                r.t_first = now
            return hidden + out + self._finish(r, "cancelled" if r.cancelling else reason, now)
        if out and r.t_first is None:
            r.t_first = now
        r.stage, r.prefilled = Stage.DECODE, True
        r.handoff = ev.get("handoff") if isinstance(ev.get("handoff"), dict) else {
            "board": b.name[:128], "request": uid or "?", "prompt_len": int(r.prompt_tokens or 0), "blocks": []}
        self.counters["pd_handoffs"] += 1
        return out + self._dispatch(r, now)

    def _detach(self, r: BRequest) -> None:
        """The current attempt is over (terminal event, or its backend is lost)."""
        if r.uid is not None:
            self._by_uid.pop(r.uid, None)
        if r.backend is not None:
            b = self.backends.get(r.backend)
            if b is not None:
                b.inflight.discard(r.rid)
                if b.probe == r.rid:
                    b.probe = None
        r.uid = None
        r.state = ReqState.PENDING

    def _drop(self, r: BRequest) -> None:
        self._detach(r)
        self._reqs.pop(r.rid, None)

    def _fail(self, r: BRequest, code: int, reason: str, message: str, retryable: bool = False,
              retry_after_ms: int | None = None) -> list:
        self.counters["failed"] += 1
        self._drop(r)
        return [FailRequest(r.rid, code, reason, message, retryable, retry_after_ms=retry_after_ms)]

    def _retry_after_ms(self, r: BRequest, now: float) -> int:
        """A retryable failure of `r`: the last backend's own estimate when it gave one, else the balancer's."""
        if r.last_retry_after_ms is not None:
            return r.last_retry_after_ms
        return self._backends_retry_ms(now)

    def _backends_retry_ms(self, now: float) -> int:
        """The balancer's own estimate: until the soonest backend may take requests again (its breaker's
        cooldown and a heartbeat, or the next heartbeat of one not accepting); the longest wait when every
        backend is drained by an admin or none is configured."""
        waits = [w for b in self.backends.values() if (w := b.ready_in(now, self.config.health)) is not None]
        return clamp_ms(min(waits) if waits else RETRY_AFTER_MAX_S)

    def _finish(self, r: BRequest, finish_reason: str, now: float) -> list:
        self.counters[f"finished_{finish_reason}"] += 1
        self._drop(r)
        n = len(r.streamed)
        prompt_tokens = len(r.msg["prompt"]) if r.msg.get("prompt") is not None else int(r.prompt_tokens or 0)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n + r.unsent, "cached_tokens": r.cached_tokens}

        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1000.0, 3)

        tpot = None
        if n > 1 and r.t_first is not None and r.t_last is not None:
            tpot = round((r.t_last - r.t_first) * 1000.0 / (n - 1), 3)
        timing = {"ttft_ms": ms(r.arrival, r.t_first), "tpot_ms": tpot, "e2e_ms": ms(r.arrival, now),
                  "retries": r.retries, "migrations": r.migrations}
        return [FinishRequest(r.rid, finish_reason, usage, timing)]

    # ------------------------------------------------------------------ one-reply ops
    def fanout(self, token: Any, op: str, now: float) -> list:
        """Ask every connected backend `op` (stats, models); the Reply comes when all answered or in time."""
        targets = [b for b in self.backends.values() if b.health in (Health.UP, Health.HALF_OPEN) and not b.removed]
        fo = Fanout(token, op, now + self.config.fanout_timeout_s, {})
        out: list = []
        for b in targets:
            uid = f"f{next(self._uids)}"
            fo.pending[uid] = b.name
            self._fanouts[uid] = fo
            out.append(SendUpstream(b.name, {"v": PROTOCOL_VERSION, "op": op, "id": uid}))
        if not targets:
            out.append(self._complete_fanout(fo, now))
        return out

    def _complete_fanout(self, fo: Fanout, now: float) -> Reply:
        if fo.op == "models":
            seen: dict[str, dict] = {}
            for body in fo.results.values():
                for m in body.get("models") or []:
                    if isinstance(m, dict) and m.get("alias") is not None:
                        seen.setdefault(m["alias"], m)
            return Reply(fo.token, "models", {"models": list(seen.values()), "backends": fo.results})
        return Reply(fo.token, fo.op, {"balancer": self.stats(now), "backends": fo.results,
                                        "total": merge_stats([_own_total(b) for b in fo.results.values()
                                                              if "error" not in b])})

    def stats(self, now: float) -> dict:
        return {"counters": dict(self.counters), "routed": dict(self.routed), "active_requests": len(self._reqs),
                "policy": self.config.routing.policy.value, "uptime_s": round(now - self.started_at, 3),
                "prefix_index_blocks": {n: self.index.size(n) for n in self.backends}}

    def health(self, now: float) -> dict:
        pol = self.config.health
        snaps = [b.snapshot(now, pol) for b in self.backends.values()]
        routable = [b for b in self.backends.values() if b.routable()]
        model = next((b.reported.get("model") for b in routable if isinstance(b.reported.get("model"), dict)), None)
        cands = [b for b in routable if not b.stale(now, pol)]
        return {
            "ok": bool(routable) and self.accepting,
            "accepting": self.accepting,
            "chips_up": sum(b.chips_up for b in routable),
            "backends_up": len(routable),
            "backends_total": len([b for b in self.backends.values() if not b.removed]),
            "active_requests": len(self._reqs) + sum(b.others_load for b in routable),
            "model": model,
            "adapters": known_adapters(routable),
            "load": _sum_load([b.reported.get("load") for b in routable]),
            "balancer": {"policy": self.config.routing.policy.value,
                         "imbalanced": bool(len(cands) > 1 and imbalanced(cands, self.config.routing)),
                         "backends": snaps},
            "uptime_s": round(now - self.started_at, 3),
        }


def _prompt_len(msg: dict) -> int:
    """Prompt tokens for routing cost: exact for token prompts, estimated for text."""
    if msg.get("prompt") is not None:
        return len(msg["prompt"])
    return len(msg["text"]) // CHARS_PER_TOKEN


def _cancel_msg(uid: str | None) -> dict:
    return {"v": PROTOCOL_VERSION, "op": "cancel", "id": uid}


def _body(ev: dict) -> dict:
    return {k: v for k, v in ev.items() if k not in ("v", "ev", "id")}


def _sum_load(loads: list) -> dict:
    """The backends' heartbeat load figures as one: queue and running summed, KV use averaged."""
    loads = [x for x in loads if isinstance(x, dict)]
    kv = [x["kv_used"] for x in loads if isinstance(x.get("kv_used"), (int, float))]
    return {"waiting": sum(int(x.get("waiting") or 0) for x in loads),
            "running": sum(int(x.get("running") or 0) for x in loads),
            "kv_used": round(sum(kv) / len(kv), 4) if kv else None}


def _own_total(body: dict) -> dict:
    """A backend's stats as one tree: a balancer's `total`, a daemon's whole body."""
    return body["total"] if isinstance(body.get("total"), dict) and "balancer" in body else body


def _count_unsent(r: BRequest, finish_reason: str, usage: dict) -> None:
    """The last leg's generated tokens that it did not send (an EOS or stop id), from its `done` usage, so the
    request's `completion_tokens` means what a board's does. A `length` finish sends everything it generated."""
    counted = usage.get("completion_tokens")
    if finish_reason != "length" and type(counted) is int:
        r.unsent = max(0, counted - (len(r.streamed) - r.leg_start))
