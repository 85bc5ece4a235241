"""The tenant lane share at admission: a tenant holding every sequence yields its youngest idle one to a
tenant waiting below its share (scenario tenant-flood in docs/benchmarks.md)."""

from __future__ import annotations

from engine.core.requests import RequestState
from engine.core.scheduler_config import SchedulerConfig, TenantPolicy
from test_scheduler_fakes import FakeExecutor, default_token, make_scheduler, params


def flooded(config: SchedulerConfig, n_flood: int = 24, mixed: int = 4096):
    """Tenant a keeps n_flood long requests outstanding on a board of config.max_sequences sequences."""
    s = make_scheduler(config, mixed=mixed)
    ex = FakeExecutor(s)
    for i in range(n_flood):
        ex.submit(i, params(n_prompt=16, max_tokens=400, seed=i, tenant="a"))
    now = 0.0
    for _ in range(20):
        ex.step(now)
        now += 0.01
    assert s.view.tenant_active("a") == config.max_sequences
    return s, ex, now


def first_token_step(s, ex, rid: int, now: float, steps: int = 400) -> int:
    for k in range(steps):
        if ex.tokens.get(rid):
            return k
        ex.step(now + k * 0.01)
    raise AssertionError(f"request {rid} had no token after {steps} steps")


def test_a_waiting_tenant_gets_a_lane_at_the_next_tick_by_preempting_the_floods_youngest():
    s, ex, now = flooded(SchedulerConfig(max_sequences=8))
    youngest = max((s.view.requests[i] for i in s.chips[0].bound), key=lambda r: r.admit_order).request_id
    ex.submit(100, params(n_prompt=16, max_tokens=4, seed=100, tenant="b"), now)
    ex.handle(s.tick(now))
    assert 100 in s.chips[0].bound  # admitted at once, not after one of a's 400-token requests
    assert s.counters["preemptions_lane_share"] == 1
    assert s.view.requests[youngest].state is RequestState.WAITING_ADMISSION  # requeued for recompute
    assert s.view.tenant_active("a") == 7
    ex.complete_all(now)
    assert first_token_step(s, ex, 100, now + 0.01) <= 2  # a decode step or two, not a whole request
    ex.run(now + 1.0)
    for rid in (youngest, 100):  # the preempted request recomputes and finishes with the same tokens
        n = 16
        max_tokens = 400 if rid == youngest else 4
        assert ex.tokens[rid] == [default_token(rid, n + k) for k in range(max_tokens)]


def test_without_a_share_the_waiting_tenant_waits_for_a_lane_to_free():
    s, ex, now = flooded(SchedulerConfig(max_sequences=8, max_tenant_lane_share=1.0))
    ex.submit(100, params(n_prompt=16, max_tokens=4, seed=100, tenant="b"), now)
    assert first_token_step(s, ex, 100, now) > 100  # behind one of a's 400-token requests
    assert s.counters["preemptions_lane_share"] == 0


def test_the_preempted_lane_does_not_go_straight_back_to_the_flood():
    """Each of b's requests, one after another, takes one lane from a, and a keeps the rest."""
    s, ex, now = flooded(SchedulerConfig(max_sequences=8))
    for k in range(5):
        rid = 100 + k
        ex.submit(rid, params(n_prompt=16, max_tokens=4, seed=rid, tenant="b"), now)
        assert first_token_step(s, ex, rid, now) <= 2
        while rid not in ex.terminal:
            ex.step(now)
            now += 0.01
    assert s.counters["preemptions_lane_share"] <= 5
    assert s.view.tenant_active("a") >= 7


def test_b_takes_lanes_up_to_its_share_and_no_more():
    s, ex, now = flooded(SchedulerConfig(max_sequences=8), n_flood=8)  # a's backlog is its 8 running ones
    for k in range(6):
        ex.submit(100 + k, params(n_prompt=16, max_tokens=300, seed=100 + k, tenant="b"), now)
    for _ in range(10):
        ex.step(now)
        now += 0.01
    assert s.view.tenant_active("b") == 4 and s.view.tenant_active("a") == 4  # the share: half each, then no more
    assert s.counters["preemptions_lane_share"] == 4


def test_a_heavier_tenant_keeps_its_weighted_share():
    cfg = SchedulerConfig(max_sequences=4, tenants={"a": TenantPolicy(weight=3.0), "b": TenantPolicy(weight=1.0)})
    s, ex, now = flooded(cfg, n_flood=4)
    ex.submit(100, params(n_prompt=16, max_tokens=300, seed=100, tenant="b"), now)
    ex.submit(101, params(n_prompt=16, max_tokens=300, seed=101, tenant="b"), now)
    for _ in range(10):
        ex.step(now)
        now += 0.01
    assert (s.view.tenant_active("a"), s.view.tenant_active("b")) == (3, 1)  # weight 3 of 4: a keeps 3


def test_a_lowered_max_sequences_drains_before_any_lane_changes_hands():
    s, ex, now = flooded(SchedulerConfig(max_sequences=8), n_flood=8)
    s.reconfigure(SchedulerConfig(max_sequences=6))
    ex.submit(100, params(n_prompt=16, max_tokens=4, seed=100, tenant="b"), now)
    ex.step(now)
    assert 100 not in s.chips[0].bound and s.counters["preemptions_lane_share"] == 0
