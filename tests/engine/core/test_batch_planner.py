"""The batch planner on its own: its decisions need no scheduler, only the config and plain records."""

from __future__ import annotations

from engine.core.batch_planner import BatchPlanner, hold_until
from engine.core.batch_profiles import lanes_for
from engine.core.prefill_queues import PrefillQueues, SmoothWeightedRoundRobin, WorkClass
from engine.core.request_record import RequestRecord
from engine.core.scheduler_config import SchedulerConfig
from test_scheduler_fakes import params


def record(rid: int, tenant: str = "default", committed: int = 0, target: int = 8, deadline=None) -> RequestRecord:
    r = RequestRecord(request_id=rid, params=params(seed=rid, tenant=tenant), arrival=0.0, deadline=deadline,
                      stop=None, tokens=[])
    r.committed, r.prefill_target = committed, target
    return r


def test_decode_profile_is_the_profile_choice_and_fitting_the_smallest_that_holds_the_lanes():
    p = BatchPlanner(SchedulerConfig(), (1, 4, 8, 16), chunked=True, mixed_batch_tokens=0)
    assert [p.decode_profile(n) for n in range(1, 40)] == [lanes_for(n, (1, 4, 8, 16))[0] for n in range(1, 40)]
    assert [p.fitting_profile(n) for n in (1, 2, 5, 9, 16)] == [1, 4, 8, 16, 16]
    assert p.mixed_budget == 0  # the model declares no mixed batches


def test_the_tenant_lane_share_caps_a_tenant_unless_nobody_else_is_ready():
    p = BatchPlanner(SchedulerConfig(max_tenant_lane_share=0.5), (4,), chunked=True, mixed_batch_tokens=0)
    a = [record(i, "a") for i in range(4)]
    b = record(9, "b")
    assert p.pick_lanes(a + [b], 4) == [a[0], a[1], b, a[2]]
    assert p.pick_lanes(a, 4) == a


def test_prompt_chunks_fill_the_budget_and_a_short_prompt_waits_rather_than_split():
    p = BatchPlanner(SchedulerConfig(prefill_chunk_tokens=16), (1, 4), chunked=True, mixed_batch_tokens=64)
    rs = {1: record(1, target=40), 2: record(2, target=10)}
    q = PrefillQueues(512, 4096)
    for rid, r in rs.items():
        q.push(rid, r.prefill_target)
    wrr = SmoothWeightedRoundRobin({WorkClass.SHORT: 4, WorkClass.MEDIUM: 2, WorkClass.LONG: 1})
    prompts, left = p.take_prompts(q, wrr, rs, 20)
    assert [(r.request_id, s, e) for r, s, e in prompts] == [(1, 0, 16)] and left == 4  # 2 (10) does not fit 4
    assert q.ids() == [2]
    assert p.prefill_end(16, 40) == 32 and p.prefill_end(32, 40) == 40


def test_a_window_holds_until_its_end_and_never_into_a_deadline():
    assert hold_until(1.0, 0.1, [record(1)], now=0.5) == 1.0
    assert hold_until(1.0, 0.1, [record(1)], now=1.0) is None
    assert hold_until(1.0, 0.25, [record(1, deadline=0.75)], now=0.25) == 0.5
