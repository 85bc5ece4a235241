"""The balancer core with a fake clock: routing, heartbeats, breaker, retries, migration, cancel."""

from __future__ import annotations

import random

from engine.balancer.actions import (CloseBackend, EmitTokens, FailRequest, FinishRequest, OpenBackend, Reply,
                                     SendUpstream)
from engine.balancer.backend_state import BackendSpec, Health, HealthPolicy
from engine.balancer.core import BalancerCore, CoreConfig
from engine.balancer.routing import Policy, RoutingPolicy
from engine.balancer.stats_merge import merge_stats
from ipc.schema import validate_request

A, B, C = "tcp://a:1", "tcp://b:1", "tcp://c:1"


def gen(prompt=(1, 2, 3), **kw) -> dict:
    return validate_request({"v": 1, "op": "generate", "id": "x", "prompt": list(prompt), **kw})


def health_body(active=0, accepting=True, chips=1, alias="tiny"):
    return {"ok": accepting, "accepting": accepting, "chips_up": chips, "active_requests": active,
            "model": {"alias": alias}, "load": {"waiting": active, "running": 0, "kv_used": 0.25}}


def make(policy=Policy.ROUND_ROBIN, names=(A, B), now=0.0, **kw) -> BalancerCore:
    cfg = CoreConfig(routing=RoutingPolicy(policy=policy, block_size=4), **kw)
    core = BalancerCore(cfg, [BackendSpec(n) for n in names], now, random.Random(7))
    assert [type(a) for a in core.take_setup_actions()] == [OpenBackend] * len(names)
    beat(core, now)
    return core


def beat(core, now, only=None, **body):
    """Run one tick (it sends heartbeats) and answer every heartbeat with a health body."""
    out = core.tick(now)
    for a in out:
        if isinstance(a, SendUpstream) and a.msg["op"] == "health" and (only is None or a.backend in only):
            core.on_event(a.backend, {"v": 1, "ev": "health", "id": a.msg["id"], **health_body(**body)}, now)
    return [a for a in out if not (isinstance(a, SendUpstream) and a.msg["op"] == "health")]


def sends(actions, op="generate"):
    return [a for a in actions if isinstance(a, SendUpstream) and a.msg["op"] == op]


def tokens(uid, toks):
    return {"v": 1, "ev": "tokens", "id": uid, "tokens": toks}


def done(uid, reason="length"):
    return {"v": 1, "ev": "done", "id": uid, "finish_reason": reason,
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0},
            "timing": {"ttft_ms": 1.0, "tpot_ms": None, "e2e_ms": 1.0}}


def error(uid, code, reason="x", retryable=True):
    return {"v": 1, "ev": "error", "id": uid, "code": code, "reason": reason, "message": "m", "retryable": retryable}


def test_no_route_before_first_heartbeat_then_round_robin():
    cfg = CoreConfig(routing=RoutingPolicy(policy=Policy.ROUND_ROBIN))
    core = BalancerCore(cfg, [BackendSpec(A), BackendSpec(B)], 0.0, random.Random(1))
    assert core.submit(1, gen(), 0.0) == []  # waits: nobody answered a heartbeat yet
    beat(core, 0.01)
    out = core.tick(0.06)
    (s,) = sends(out)
    targets = [s.backend] + [sends(core.submit(i, gen(), 0.1))[0].backend for i in range(2, 6)]
    assert targets[1:] == [targets[1], targets[2]] * 2 and set(targets) == {A, B}
    assert s.msg["stream"] is True and s.msg["id"] != "x"


def test_missed_heartbeats_take_a_backend_out_after_three_intervals_and_it_comes_back():
    core = make()
    for t in (1.0, 2.0, 3.0):
        beat(core, t, only={B})
    assert core.backends[A].health is Health.UP  # last reply at 0.0; 3.0 s is not more than 3 x 1 s
    beat(core, 3.01, only={B})
    assert core.backends[A].health is Health.OUT and "missed heartbeats" in core.backends[A].reason
    assert {sends(core.submit(i, gen(), 3.1))[0].backend for i in range(4)} == {B}
    beat(core, 4.2)  # replies again after the cooldown: half-open, the next request is its probe
    assert core.backends[A].health is Health.HALF_OPEN
    (probe,) = sends(core.submit(10, gen(), 4.3))
    assert probe.backend == A
    core.on_event(A, tokens(probe.msg["id"], [5]), 4.4)
    assert core.backends[A].health is Health.UP


def test_health_aggregates_the_backends_and_says_which_are_out():
    core = make(names=(A, B, C))
    beat(core, 1.0, only={A, C}, active=2)
    beat(core, 2.0, only={A, C}, active=2)
    beat(core, 3.5, only={A, C}, active=2)
    h = core.health(3.5)
    assert (h["ok"], h["backends_up"], h["backends_total"], h["chips_up"]) == (True, 2, 3, 2)
    assert h["load"] == {"waiting": 4, "running": 0, "kv_used": 0.25} and h["active_requests"] == 4
    (out,) = [b for b in h["balancer"]["backends"] if b["state"] == "out"]
    assert out["endpoint"] == B and "missed heartbeats" in out["reason"]


def test_stale_load_figure_counts_as_saturated():
    core = make(policy=Policy.LEAST_LOAD)
    beat(core, 1.0, only={B})
    beat(core, 2.0, only={B})
    beat(core, 2.5, only={B}, active=5)  # A's figure is 2.5 s old: saturated though idle
    assert not core.backends[A].stale(1.9, core.config.health) and core.backends[A].stale(2.5, core.config.health)
    assert sends(core.submit(1, gen(), 2.5))[0].backend == B


def test_429_is_retried_elsewhere_with_backoff_and_bounded():
    core = make(max_retries=2, backoff_base_s=0.1)
    (s,) = sends(core.submit(1, gen(), 0.1))
    assert core.on_event(s.backend, error(s.msg["id"], 429, "overloaded"), 0.1) == []  # waits for the backoff
    assert core.tick(0.1 + 0.04) == []  # jitter is 50-100 % of 0.1 s
    (s2,) = sends(core.tick(0.21))
    assert s2.backend != s.backend and s2.msg["id"] != s.msg["id"]
    core.on_event(s2.backend, error(s2.msg["id"], 503, "draining"), 0.21)
    (s3,) = sends(core.tick(0.5))
    (f,) = core.on_event(s3.backend, error(s3.msg["id"], 429, "overloaded"), 0.5)
    assert isinstance(f, FailRequest) and f.code == 429 and "after 2 retries" in f.message


def test_non_retryable_error_passes_through():
    core = make()
    (s,) = sends(core.submit(1, gen(), 0.1))
    (f,) = core.on_event(s.backend, error(s.msg["id"], 400, "continuation_too_long", False), 0.1)
    assert (f.code, f.reason, f.retryable) == (400, "continuation_too_long", False)


def test_retry_respects_the_deadline():
    core = make(backoff_base_s=0.5)
    (s,) = sends(core.submit(1, gen(deadline_ms=300), 0.1))
    assert s.msg["deadline_ms"] == 300
    (f,) = core.on_event(s.backend, error(s.msg["id"], 429), 0.2)
    assert (f.code, f.reason) == (504, "deadline_exceeded")


def test_backend_death_before_first_token_retries_at_once_elsewhere():
    core = make()
    (s,) = sends(core.submit(1, gen(), 0.1))
    (s2,) = sends(core.on_disconnect(s.backend, 0.2))
    assert s2.backend != s.backend and "continuation" not in s2.msg or s2.msg["continuation"] == []
    assert core.backends[s.backend].health is Health.OUT


def test_broken_stream_is_migrated_with_a_continuation_and_reads_as_one_stream():
    core = make(names=(A, B, C))
    (s,) = sends(core.submit(1, gen(prompt=[9, 8], seed=5, max_tokens=6, continuation=[1]), 0.1))
    emitted = []
    for a in core.on_event(s.backend, tokens(s.msg["id"], [10, 11]), 0.2):
        emitted += a.tokens
    (m,) = sends(core.on_disconnect(s.backend, 0.3))
    assert m.backend != s.backend
    assert m.msg["prompt"] == [9, 8] and m.msg["continuation"] == [1, 10, 11] and m.msg["seed"] == 5
    assert m.msg["max_tokens"] == 6
    core.on_event(s.backend, tokens(s.msg["id"], [99]), 0.31)  # a late event of the dead attempt: dropped
    out = core.on_event(m.backend, tokens(m.msg["id"], [12, 13]), 0.4)
    out += core.on_event(m.backend, done(m.msg["id"]), 0.5)
    emitted += [t for a in out if isinstance(a, EmitTokens) for t in a.tokens]
    fin = [a for a in out if isinstance(a, FinishRequest)]
    assert emitted == [10, 11, 12, 13]
    assert len(fin) == 1 and fin[0].usage["completion_tokens"] == 4 and fin[0].timing["migrations"] == 1


def test_completion_tokens_count_the_eos_the_last_leg_generated_but_did_not_send():
    core = make(names=(A, B))
    (s,) = sends(core.submit(1, gen(max_tokens=8), 0.1))
    core.on_event(s.backend, tokens(s.msg["id"], [10, 11]), 0.2)
    (m,) = sends(core.on_disconnect(s.backend, 0.3))
    core.on_event(m.backend, tokens(m.msg["id"], [12]), 0.4)
    ev = done(m.msg["id"], "eos")
    ev["usage"]["completion_tokens"] = 2  # the migrated leg sampled 12 and the EOS; the continuation not counted
    (fin,) = [a for a in core.on_event(m.backend, ev, 0.5) if isinstance(a, FinishRequest)]
    assert fin.finish_reason == "eos" and fin.usage["completion_tokens"] == 4


def test_migration_exhausted_ends_with_one_retryable_503():
    core = make(names=(A, B), max_migrations=1)
    (s,) = sends(core.submit(1, gen(), 0.1))
    core.on_event(s.backend, tokens(s.msg["id"], [4]), 0.1)
    (m,) = sends(core.on_disconnect(s.backend, 0.2))
    core.on_event(m.backend, tokens(m.msg["id"], [5]), 0.2)
    out = core.on_disconnect(m.backend, 0.3)
    assert [type(a) for a in out] == [FailRequest]
    assert (out[0].code, out[0].retryable) == (503, True)
    assert core.active() == 0


def test_migration_off_ends_the_stream_with_503():
    core = make(migrate=False)
    (s,) = sends(core.submit(1, gen(), 0.1))
    core.on_event(s.backend, tokens(s.msg["id"], [4]), 0.1)
    (f,) = core.on_event(s.backend, error(s.msg["id"], 500, "chip_failed", True), 0.2)
    assert (f.code, f.reason, f.retryable) == (503, "stream_broken", True)


def test_cancel_follows_the_request_after_a_migration():
    core = make()
    (s,) = sends(core.submit(1, gen(), 0.1))
    core.on_event(s.backend, tokens(s.msg["id"], [4]), 0.1)
    (m,) = sends(core.on_disconnect(s.backend, 0.2))
    (c,) = core.cancel(1, 0.3)
    assert c.backend == m.backend and c.msg == {"v": 1, "op": "cancel", "id": m.msg["id"]}
    (f,) = [a for a in core.on_event(m.backend, done(m.msg["id"], "cancelled"), 0.4) if isinstance(a, FinishRequest)]
    assert f.finish_reason == "cancelled"


def test_cancel_of_a_waiting_request_finishes_it_at_once():
    core2 = BalancerCore(CoreConfig(), [BackendSpec(A)], 0.0)
    assert core2.submit(1, gen(), 0.0) == []
    (f,) = core2.cancel(1, 0.1)
    assert isinstance(f, FinishRequest) and f.finish_reason == "cancelled"


def test_vanished_client_cancels_upstream():
    core = make()
    (s,) = sends(core.submit(1, gen(), 0.1))
    (c,) = core.client_gone([1], 0.2)
    assert c.backend == s.backend and c.msg["op"] == "cancel" and c.msg["id"] == s.msg["id"]
    assert core.active() == 0 and core.on_event(s.backend, tokens(s.msg["id"], [1]), 0.3) == []


def test_hung_backend_streams_are_migrated_and_cancelled_there():
    core = make()
    (s,) = sends(core.submit(1, gen(), 0.1))
    core.on_event(s.backend, tokens(s.msg["id"], [4]), 0.1)
    other = B if s.backend == A else A
    for t in (1.0, 2.0, 3.0):
        beat(core, t, only={other})
    out = beat(core, 3.05, only={other})
    cancel = [a for a in out if isinstance(a, SendUpstream) and a.msg["op"] == "cancel"]
    (m,) = sends(out)
    assert cancel[0].backend == s.backend and m.backend == other and m.msg["continuation"] == [4]


def test_breaker_opens_after_failures_and_half_open_probe_failure_doubles_the_cooldown():
    core = make(names=(A,), health=HealthPolicy(failure_threshold=2, cooldown_s=1.0))
    for i, t in ((1, 0.1), (2, 0.2)):
        (s,) = sends(core.submit(i, gen(), t))
        core.on_event(A, error(s.msg["id"], 500, "internal", False), t)
    assert core.backends[A].health is Health.OUT
    beat(core, 1.0)
    assert core.backends[A].health is Health.OUT  # 0.8 s since opening < cooldown
    beat(core, 2.0)
    assert core.backends[A].health is Health.HALF_OPEN
    (p,) = sends(core.submit(3, gen(), 2.1))
    assert core.submit(4, gen(), 2.1) == []  # one probe at a time; this one waits
    core.on_event(A, error(p.msg["id"], 500, "internal", False), 2.2)
    assert core.backends[A].health is Health.OUT and core.backends[A].cooldown_s == 2.0


def test_prefix_policy_goes_where_the_prefix_was_sent_and_the_guard_spreads_load():
    cfg = CoreConfig(routing=RoutingPolicy(policy=Policy.PREFIX, block_size=4, decode_cost_tokens=1,
                                           imbalance_abs=3, imbalance_rel=2.0))
    core = BalancerCore(cfg, [BackendSpec(A), BackendSpec(B)], 0.0, random.Random(1))
    beat(core, 0.0)
    shared = list(range(100, 132))  # 8 blocks
    (first,) = sends(core.submit(1, gen(prompt=shared + [1]), 0.1))
    (second,) = sends(core.submit(2, gen(prompt=shared + [2]), 0.1))
    assert second.backend == first.backend  # 32 cached tokens beat one request of load
    (fresh,) = sends(core.submit(3, gen(prompt=list(range(7, 40))), 0.1))
    assert fresh.backend != first.backend
    targets = [sends(core.submit(i, gen(prompt=shared + [i]), 0.2))[0].backend for i in range(4, 12)]
    assert set(targets) == {A, B}  # the guard: a hot prefix cannot pile everything onto one backend
    assert core.counters["imbalance_fallbacks"] > 0


def test_drained_and_removed_backends_get_no_new_requests_but_finish_theirs():
    core = make()
    assert core.set_drained(A, True)
    assert {sends(core.submit(i, gen(), 0.1))[0].backend for i in range(3)} == {B}
    core.set_drained(A, False)
    (s,) = [x for x in (sends(core.submit(i, gen(), 0.2))[0] for i in range(10, 12)) if x.backend == A]
    out = core.set_backends([BackendSpec(B), BackendSpec(C)], 0.3)
    assert OpenBackend(C) in out and not any(isinstance(a, CloseBackend) for a in out)
    beat(core, 0.3)
    assert all(sends(core.submit(i, gen(), 0.4))[0].backend != A for i in range(20, 24))
    evs = core.on_event(A, tokens(s.msg["id"], [1]), 0.5) + core.on_event(A, done(s.msg["id"]), 0.5)
    assert any(isinstance(a, FinishRequest) for a in evs)
    assert CloseBackend(A) in core.tick(0.6)


def test_pools_by_priority():
    cfg = CoreConfig(pools=(("low-latency", 50), ("bulk", -100)))
    core = BalancerCore(cfg, [BackendSpec(A, pool="low-latency"), BackendSpec(B, pool="bulk")], 0.0)
    beat(core, 0.0)
    assert {sends(core.submit(i, gen(priority=60), 0.1))[0].backend for i in range(3)} == {A}
    assert {sends(core.submit(i, gen(priority=0), 0.1))[0].backend for i in range(3, 6)} == {B}
    assert {sends(core.submit(i, gen(priority=0, pool="low-latency"), 0.1))[0].backend for i in range(6, 9)} == {A}
    assert sends(core.submit(9, gen(pool="no-such-pool"), 0.1))  # an empty pool falls back to any backend


def test_stats_fan_out_and_aggregate():
    core = make()
    out = core.fanout("tok", "stats", 0.1)
    assert len(out) == 2
    core.on_event(out[0].backend, {"v": 1, "ev": "stats", "id": out[0].msg["id"], "frontend": {"requests": 2}}, 0.1)
    (r,) = core.on_event(out[1].backend, {"v": 1, "ev": "stats", "id": out[1].msg["id"],
                                          "frontend": {"requests": 3}}, 0.1)
    assert isinstance(r, Reply) and r.token == "tok" and r.body["total"]["frontend"]["requests"] == 5
    out = core.fanout("t2", "stats", 0.2)
    core.on_event(out[0].backend, {"v": 1, "ev": "stats", "id": out[0].msg["id"], "x": 1}, 0.2)
    (late,) = [a for a in core.tick(0.2 + core.config.fanout_timeout_s) if isinstance(a, Reply)]
    assert late.body["backends"][out[1].backend] == {"error": "no reply in time"}


def test_merge_stats_sums_numbers_and_nests():
    assert merge_stats([{"a": 1, "b": {"c": 2.5}, "s": "x"}, {"a": 2, "b": {"c": 1, "d": 4}, "s": "y"}]) == \
        {"a": 3, "b": {"c": 3.5, "d": 4}, "s": "x"}


def test_shutdown_ends_every_request_once_and_cancels_upstream():
    core = make()
    (s,) = sends(core.submit(1, gen(), 0.1))
    out = core.shutdown(0.2)
    assert [type(a) for a in out] == [SendUpstream, FailRequest] and out[1].code == 503
    assert core.submit(2, gen(), 0.3)[0].reason == "draining"


def test_a_drain_with_a_timeout_lets_requests_finish_then_ends_the_rest_and_resume_clears_it():
    core = make()
    (s1,) = sends(core.submit(1, gen(), 0.1))
    (s2,) = sends(core.submit(2, gen(), 0.1))
    core.drain(0.2, timeout_s=1.0)
    assert core.submit(3, gen(), 0.3)[0].reason == "draining" and core.next_wakeup(0.3) <= 1.2
    out = core.on_event(s1.backend, done(s1.msg["id"]), 0.5)  # in flight: it finishes normally
    assert [type(a) for a in out] == [FinishRequest]
    assert not [a for a in core.tick(1.1) if isinstance(a, FailRequest)]  # before the deadline: nothing ends
    out = [a for a in core.tick(1.2) if not (isinstance(a, SendUpstream) and a.msg["op"] == "health")]
    assert [type(a) for a in out] == [SendUpstream, FailRequest]
    assert out[0].msg["op"] == "cancel" and out[0].msg["id"] == s2.msg["id"]
    assert (out[1].request_id, out[1].code, out[1].reason, out[1].retryable) == (2, 503, "shutdown", True)
    assert core.active() == 0 and core.counters["drain_timed_out"] == 1
    core.resume()
    assert core.accepting and core.drain_deadline is None and sends(core.submit(4, gen(), 1.3))
    core.drain(1.4, timeout_s=None)  # no timeout: nothing is ever ended by the drain
    assert core.drain_deadline is None and not core.accepting


def test_the_shells_fast_tokens_check_passes_only_well_formed_events():
    import orjson

    from engine.balancer.shell import _tokens_fast

    ok = {"v": 1, "ev": "tokens", "id": "g1", "tokens": [1, 2]}
    assert _tokens_fast(orjson.dumps(ok)) == ok
    for bad in ({**ok, "tokens": []}, {**ok, "tokens": [True]}, {**ok, "tokens": [-1]}, {**ok, "tokens": ["1"]},
                {**ok, "tokens": [1 << 31]}, {**ok, "id": None}, {**ok, "v": 2}, {**ok, "logprobs": [0.0, 0.0]},
                {**ok, "ev": "done"}, [1]):
        assert _tokens_fast(orjson.dumps(bad)) is None, bad  # these go through the full decode_event check
    assert _tokens_fast(b"{nope") is None


def test_block_hashes_chain_over_the_prefix_and_the_index_is_a_bounded_lru():
    from engine.balancer.prefix_index import PrefixIndex, block_hashes, text_block_hashes

    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2  # the partial last block is not named
    assert block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == a[0] and block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[1] != a[1]
    assert block_hashes([7, 7, 7, 7, 4, 5, 6, 7], 4)[1] != a[1]  # same block after a different prefix
    t = text_block_hashes("abcdefgh", 4)
    assert len(t) == 2 and text_block_hashes("abcdxxxx", 4)[0] == t[0]
    idx = PrefixIndex(capacity_blocks=3)
    idx.record("x", a)
    assert idx.matched("x", a) == 2 and idx.matched("y", a) == 0
    other = block_hashes(list(range(100, 108)), 4)
    idx.record("x", other)  # 4 blocks into 3 slots: the oldest (a[0]) goes, and with it the prefix match
    assert idx.matched("x", a) == 0 and idx.matched("x", other) == 2 and idx.size("x") == 3
    idx.forget("x")
    assert idx.matched("x", other) == 0


def test_a_model_no_backend_serves_is_404_at_once_and_a_served_one_is_routed_to_its_boards():
    core = BalancerCore(CoreConfig(), [BackendSpec(A), BackendSpec(B)], 0.0)
    out = core.tick(0.0)
    for a in out:
        alias = "big" if a.backend == A else "tiny"
        core.on_event(a.backend, {"v": 1, "ev": "health", "id": a.msg["id"], **health_body(alias=alias)}, 0.0)
    (f,) = core.submit(1, gen(model="nope"), 0.1)
    assert (f.code, f.reason) == (404, "model_not_found") and "big, tiny" in f.message
    assert {sends(core.submit(i, gen(model="big"), 0.1))[0].backend for i in range(2, 5)} == {A}
