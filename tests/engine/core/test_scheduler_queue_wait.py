"""admission.max_queue_wait_ms with a fake clock: a request that waits that long for admission gets 429
`queue_wait_exceeded` (retryable), once, in arrival order; a new one is turned away at submit while its lane's
oldest has waited that long; 0 leaves the wait unbounded."""

from __future__ import annotations

import dataclasses

from engine.config import load_config
from engine.config_reload import config_changes, reloaded
from engine.core.actions import FailRequest, FinishRequest
from engine.core.fair_queue import WeightedFairQueue
from engine.core.scheduler_config import SchedulerConfig, TenantPolicy, scheduler_config_from
from test_scheduler_fakes import FakeExecutor, make_scheduler, params

BOUND = 1.0  # seconds


def one_lane(bound: float = BOUND, **kw):
    """One sequence at a time, so everything after the first request waits for admission."""
    s = make_scheduler(SchedulerConfig(max_sequences=1, max_queue_wait_s=bound, **kw))
    return s, FakeExecutor(s)


def expired(ex: FakeExecutor) -> list[int]:
    """Request ids that got the queue-wait 429, in the order they got it."""
    return [rid for kind, rid in ex.order if kind == "done" and isinstance(ex.terminal[rid], FailRequest)
            and ex.terminal[rid].reason == "queue_wait_exceeded"]


def test_waits_past_the_bound_get_429_once_in_arrival_order():
    s, ex = one_lane()
    ex.submit(1, params(seed=1, max_tokens=50))
    ex.handle(s.tick(0.0))  # admitted, then holds the only lane
    # later arrivals first in the fair order: arrival, not priority, decides when a wait runs out
    for rid, t, prio in ((2, 0.1, 0), (3, 0.2, 5), (4, 0.3, 9)):
        ex.submit(rid, params(seed=rid, priority=prio), t)
    ex.handle(s.tick(0.3))
    assert s.stats()["active_sequences"] == 1 and not expired(ex)
    assert s.next_wakeup(0.3) == 0.1 + BOUND  # the shell wakes for the first wait to run out
    ex.handle(s.tick(s.next_wakeup(0.3)))  # the wake-up itself expires it (no spin on a wait not quite up)
    assert expired(ex) == [2]
    ex.handle(s.tick(1.15))
    assert expired(ex) == [2]
    ex.handle(s.tick(1.4))
    assert expired(ex) == [2, 3, 4]
    for rid in (2, 3, 4):
        f = ex.terminal[rid]
        assert (f.code, f.retryable) == (429, True) and "max_queue_wait_ms" in f.message
        assert f.timing is not None and f.timing["queue_ms"] >= BOUND * 1000 and f.timing["ttft_ms"] is None
    assert s.counters["failed_queue_wait_exceeded"] == 3 and s.counters["rejected"] == 0
    st = s.stats()
    assert (st["waiting_requests"], st["waiting_prompt_tokens"]) == (0, 0)
    ex.handle(s.tick(5.0))  # nothing expires twice (the fake executor refuses a second terminal)
    ex.run(5.0)
    assert isinstance(ex.terminal[1], FinishRequest) and ex.terminal[1].finish_reason == "length"


def test_a_request_admitted_before_the_bound_is_unaffected():
    s, ex = one_lane()
    ex.submit(1, params(seed=1, max_tokens=30))
    ex.submit(2, params(seed=2, max_tokens=30), 0.0)
    now = 0.0
    while 1 not in ex.terminal:  # request 1 takes 0.3 s; request 2 then decodes long past 1 s of age
        ex.step(now)
        now += 0.01
    assert 0.25 < now < BOUND
    end = ex.run(now, dt=0.1)
    assert end > 2 * BOUND
    assert [ex.terminal[i].finish_reason for i in (1, 2)] == ["length", "length"] and not expired(ex)
    assert len(ex.tokens[2]) == 30


def test_submit_is_turned_away_when_the_oldest_waiter_has_already_waited_the_bound():
    s, ex = one_lane()
    ex.submit(1, params(seed=1))
    ex.handle(s.tick(0.0))
    ex.submit(2, params(seed=2), 0.0)  # waits behind 1
    assert s.submit(3, params(seed=3), 0.99) == []  # the head has waited 0.99 s: there is hope
    [no] = s.submit(4, params(seed=4), 1.0)  # no tick since: request 2 is still queued, 1 s old
    assert isinstance(no, FailRequest)
    assert (no.code, no.reason, no.retryable, no.timing) == (429, "queue_wait_exceeded", True, None)
    assert s.counters["rejected_queue_wait_exceeded"] == 1 and s.counters["rejected"] == 1
    assert s.stats()["waiting_requests"] == 2  # 2 and 3; 4 never joined
    ex.handle(s.tick(1.0))
    assert expired(ex) == [2]
    assert s.submit(5, params(seed=5), 1.0) == []  # the head is 3 now, 0.01 s old


def test_zero_is_off_waits_are_unbounded_as_before():
    s, ex = one_lane(bound=0.0, job_timeout_s=1000.0)
    ex.submit(1, params(seed=1, max_tokens=50))
    ex.submit(2, params(seed=2), 0.0)
    ex.handle(s.tick(0.0))
    ex.handle(s.tick(100.0))  # under the default 120 s deadline
    assert s.submit(3, params(seed=3), 100.0) == []
    ex.handle(s.tick(100.0))
    assert s.next_wakeup(100.0) == 120.0  # the first deadline: no queue-wait wake-up
    assert not ex.terminal and s.stats()["waiting_requests"] == 2


def test_a_deadline_passed_in_the_queue_is_still_504():
    s, ex = one_lane()
    ex.submit(1, params(seed=1, max_tokens=50))
    ex.submit(2, params(seed=2, deadline_ms=500), 0.0)
    ex.submit(3, params(seed=3, deadline_ms=1000), 0.0)  # deadline and bound fall due together
    ex.handle(s.tick(0.6))
    assert (ex.terminal[2].code, ex.terminal[2].reason) == (504, "deadline_exceeded")
    ex.handle(s.tick(1.0))
    assert (ex.terminal[3].code, ex.terminal[3].reason) == (504, "deadline_exceeded")
    assert not expired(ex)


def test_tenants_each_lane_judged_by_its_own_oldest():
    tenants = {"a": TenantPolicy(max_active_sequences=1, max_waiting_tokens=16), "b": TenantPolicy()}
    s = make_scheduler(SchedulerConfig(max_sequences=8, max_queue_wait_s=BOUND, tenants=tenants))
    ex = FakeExecutor(s)
    ex.submit(1, params(seed=1, max_tokens=50, tenant="a"))
    ex.handle(s.tick(0.0))
    ex.submit(2, params(seed=2, tenant="a"), 0.0)  # waits: tenant a holds its one sequence
    # at 1.0 (no tick since) a's lane has waited the bound; b's lane is empty: b is not turned away
    assert s.submit(10, params(seed=10, tenant="b"), 1.0) == []
    [no] = s.submit(4, params(seed=4, tenant="a"), 1.0)
    assert no.reason == "queue_wait_exceeded"
    ex.handle(s.tick(1.0))
    assert expired(ex) == [2]  # b's request was admitted, a's waiter expired
    assert s.stats()["waiting_requests"] == 0
    # a's quota (16 tokens) holds both only if request 2's 8 waiting tokens were given back
    assert s.submit(5, params(seed=5, tenant="a"), 1.0) == []
    assert s.submit(6, params(seed=6, tenant="a"), 1.0) == []


def test_cancel_of_a_waiting_request_and_the_bound_give_one_terminal_event():
    s, ex = one_lane()
    ex.submit(1, params(seed=1, max_tokens=50))
    ex.submit(2, params(seed=2), 0.0)
    ex.handle(s.tick(0.0))
    ex.submit(3, params(seed=3), 0.1)
    ex.handle(s.cancel(2, 0.5))
    assert ex.terminal[2].finish_reason == "cancelled"
    ex.handle(s.tick(0.5))
    assert s.next_wakeup(0.5) == 0.1 + BOUND  # the cancelled one does not set the wake-up
    ex.handle(s.tick(2.0))  # a second terminal for 2 would fail in the fake executor
    assert expired(ex) == [3]
    assert s.cancel(3, 2.1) == []  # and a cancel after the 429 adds nothing
    assert s.counters["failed_queue_wait_exceeded"] == 1


def test_reload_sets_lifts_and_changes_the_bound():
    s, ex = one_lane(bound=0.0)
    ex.submit(1, params(seed=1, max_tokens=50))
    ex.submit(2, params(seed=2), 0.0)
    ex.submit(3, params(seed=3), 4.0)
    ex.handle(s.tick(4.0))
    assert not ex.terminal
    s.reconfigure(dataclasses.replace(s.config, max_queue_wait_s=5.0))
    assert s.next_wakeup(4.0) == 4.0  # reconfigure marks the scheduler dirty
    ex.handle(s.tick(5.0))
    assert expired(ex) == [2]
    s.reconfigure(dataclasses.replace(s.config, max_queue_wait_s=0.5))  # lowered: 3 has waited 1.5 s already
    [no] = s.submit(4, params(seed=4), 5.5)
    assert no.reason == "queue_wait_exceeded" and "500 ms" in no.message
    ex.handle(s.tick(5.5))
    assert expired(ex) == [2, 3]
    s.reconfigure(dataclasses.replace(s.config, max_queue_wait_s=0.0))  # lifted
    ex.submit(5, params(seed=5), 6.0)
    ex.handle(s.tick(30.0))
    assert expired(ex) == [2, 3] and 5 not in ex.terminal


def test_fair_queue_oldest_follows_push_order_per_tenant_and_stays_small():
    q = WeightedFairQueue(lambda t: 1.0)
    q.push(1, "a", 1.0, priority=0)
    q.push(2, "b", 1.0)
    q.push(3, "a", 1.0, priority=9)  # served before 1, but younger
    assert (q.oldest(), q.oldest("a"), q.oldest("b"), q.oldest("c")) == (1, 1, 2, None)
    q.pop(3)
    q.remove(1)
    q.push(1, "a", 1.0)  # an id pushed again is as young as its new push (its old entry is still in front)
    assert (q.oldest(), q.oldest("a")) == (2, 1)
    q.remove(1)
    assert (q.oldest(), q.oldest("a")) == (2, None)
    q.push(1, "a", 1.0)
    for i in range(100, 10_100):  # nobody asks for the oldest (the bound is off): memory follows the queue
        q.push(i, "a" if i % 2 else "b", 1.0)
        q.remove(i)
    assert len(q._age._q) < 100 and all(len(o._q) < 100 for o in q._tenant_age.values())
    assert (q.oldest(), q.oldest("a"), q.oldest("b")) == (2, 1, 2)


def test_the_config_key_reaches_the_scheduler_and_is_reloadable():
    env = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    old = load_config(None, {}, env=env)
    new = load_config(None, {"admission.max_queue_wait_ms": 2000}, env=env)
    assert (old.admission.max_queue_wait_ms, scheduler_config_from(old).max_queue_wait_s) == (0, 0.0)
    [change] = config_changes(old, new)
    assert (change.key, change.old, change.new, change.reloadable) == ("admission.max_queue_wait_ms", 0, 2000, True)
    assert scheduler_config_from(reloaded(old, new)).max_queue_wait_s == 2.0
