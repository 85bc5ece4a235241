"""`Scheduler.reconfigure` (SIGHUP reload): new budgets and tenant weights apply to what comes next."""

from __future__ import annotations

import dataclasses

import pytest

from engine.core.actions import FailRequest
from engine.core.scheduler_config import SchedulerConfig, TenantPolicy
from test_scheduler_fakes import FakeExecutor, make_scheduler, params


def test_a_raised_waiting_budget_admits_what_the_old_one_refused():
    s = make_scheduler(SchedulerConfig(max_waiting_requests=1))
    assert s.submit(1, params(seed=1), 0.0) == []
    [refused] = s.submit(2, params(seed=2), 0.0)
    assert isinstance(refused, FailRequest) and (refused.code, refused.reason) == (429, "queue_full")
    s.reconfigure(dataclasses.replace(s.config, max_waiting_requests=3))
    assert s.submit(3, params(seed=3), 0.0) == []
    assert s.budget.max_waiting_requests == 3


def test_a_lowered_max_sequences_stops_new_admissions_but_keeps_admitted_ones():
    s = make_scheduler(SchedulerConfig(max_sequences=4))
    ex = FakeExecutor(s)
    for i in range(4):
        ex.submit(i, params(seed=i, max_tokens=3))
    ex.handle(s.tick(0.0))
    assert s.stats()["active_sequences"] == 4
    s.reconfigure(dataclasses.replace(s.config, max_sequences=1))
    for i in range(4, 8):
        ex.submit(i, params(seed=i, max_tokens=3))
    most_after_old_ones = 0
    now = 0.0
    while s.has_work():
        ex.complete_all(now)
        ex.handle(s.tick(now))
        if all(i in ex.terminal for i in range(4)):
            most_after_old_ones = max(most_after_old_ones, s.stats()["active_sequences"])
        now += 0.01
    assert sorted(ex.terminal) == list(range(8))
    assert all(ex.terminal[i].finish_reason == "length" for i in range(8))  # the admitted four were not cut
    assert most_after_old_ones == 1


def test_raised_tenant_weight_gets_its_larger_share_after_reload():
    s = make_scheduler(SchedulerConfig(max_sequences=1, tenants={"a": TenantPolicy(), "b": TenantPolicy()}))
    ex = FakeExecutor(s)
    for i in range(8):
        ex.submit(i, params(seed=i, max_tokens=2, tenant="a"))
        ex.submit(100 + i, params(seed=i, max_tokens=2, tenant="b"))
    s.reconfigure(dataclasses.replace(s.config, tenants={"a": TenantPolicy(weight=1.0),
                                                         "b": TenantPolicy(weight=3.0)}))
    ex.run()
    first_eight = [rid for kind, rid in ex.order if kind == "done"][:8]
    assert sum(rid >= 100 for rid in first_eight) >= 6, first_eight  # equal weights would give 4


def test_settings_baked_into_chip_state_cannot_change_by_reload():
    s = make_scheduler(SchedulerConfig())
    with pytest.raises(AssertionError, match="decode_weight"):
        s.reconfigure(dataclasses.replace(s.config, decode_weight=3))
