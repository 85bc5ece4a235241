"""Ping/pong's automatic downgrade to one job in flight, and the operator's re-enable (fake clock)."""

from __future__ import annotations

import numpy as np

from engine.core.inflight_governor import DowngradeReason, GovernorPolicy, InflightGovernor
from engine.core.scheduler_config import SchedulerConfig
from ipc.records import JobResult, JobStatus
from test_scheduler_fakes import FakeExecutor, kv_fully_free, make_scheduler, params


def test_each_trigger_downgrades_once_and_reenable_restores() -> None:
    g = InflightGovernor(GovernorPolicy(max_inflight=2, timeouts=2))
    assert g.limit() == 2
    assert not g.on_timeout() and g.limit() == 2  # one timeout is not "repeated"
    assert g.on_timeout() and g.limit() == 1 and g.downgraded is DowngradeReason.TIMEOUTS
    assert not g.on_crosstalk() and g.downgrades == 1  # already down: counted once
    assert g.reenable() and g.limit() == 2 and g.timeouts == 0
    assert g.on_status_anomaly() and g.downgraded is DowngradeReason.STATUS
    g.reenable()
    assert g.on_crosstalk() and g.downgraded is DowngradeReason.CROSSTALK
    assert not InflightGovernor(GovernorPolicy(max_inflight=1)).on_crosstalk()  # nothing to downgrade


def test_tpot_regression_against_the_one_in_flight_window() -> None:
    g = InflightGovernor(GovernorPolicy(max_inflight=2, tpot_regression=1.5, window=10))
    assert g.limit() == 1  # the baseline window runs at one in flight
    for _ in range(10):
        g.on_interval(0.010)
    assert g.baseline_p99 == 0.010 and g.limit() == 2
    for _ in range(10):
        assert not g.on_interval(0.014)  # 1.4x: within the threshold
    assert g.limit() == 2
    hits = [g.on_interval(0.020) for _ in range(10)]
    assert hits[-1] and g.downgraded is DowngradeReason.TPOT and g.limit() == 1
    g.reenable()
    assert g.limit() == 1 and g.baseline_p99 == 0.010  # a fresh baseline window first


def _run_until_two_inflight(ex: FakeExecutor, now: float = 0.0) -> None:
    for _ in range(200):
        ex.handle(ex.sched.tick(now))
        if len(ex.sched.chips[0].inflight) == 2:
            return
        if ex.pending:
            ex.complete_one(now, 0)
    raise AssertionError("never two jobs in flight")


def test_a_failed_job_downgrades_the_chip_new_jobs_only_and_the_op_reenables() -> None:
    s = make_scheduler(SchedulerConfig(max_inflight=2))
    ex = FakeExecutor(s)
    for rid in range(1, 9):
        ex.submit(rid, params(max_tokens=30, seed=rid))
    _run_until_two_inflight(ex)
    chip, job = ex.pending.pop(0)
    ex.handle(s.on_result(chip, ex.result_for(job, JobStatus.FAILED), 1.0))
    assert s.take_notices() == [("inflight_downgraded", 0, "status_anomaly")] and not s.take_notices()
    assert s.counters["inflight_downgrades_status_anomaly"] == 1
    assert len(s.chips[0].inflight) == 1  # the other job drains
    now = 1.0
    seen = []
    for _ in range(40):  # from now on one job at a time
        ex.handle(s.tick(now))
        seen.append(len(s.chips[0].inflight))
        ex.complete_one(now, 0)
        now += 0.01
    assert max(seen) == 1
    assert s.stats()["chips"]["0"]["inflight_governor"]["downgraded"] == "status_anomaly"
    assert s.reenable_inflight() == [0] and s.reenable_inflight() == []
    ex.handle(s.tick(now))
    assert len(s.chips[0].inflight) == 2 or not s.chips[0].decode_ready
    ex.run(now)
    ex.handle(s.on_chip_up(0, 99.0))  # the failed job's KV was quarantined
    assert kv_fully_free(s) and len(ex.terminal) == 8


def test_a_result_of_the_wrong_shape_is_crosstalk() -> None:
    s = make_scheduler(SchedulerConfig(max_inflight=2))
    ex = FakeExecutor(s)
    for rid in range(1, 5):
        ex.submit(rid, params(max_tokens=10, seed=rid))
    _run_until_two_inflight(ex)
    chip, job = ex.pending.pop(0)
    wrong = JobResult(job_id=job.job_id, generation=job.generation, kind=job.kind, status=JobStatus.OK,
                      tokens=np.ones(job.batch + 1, np.int32), logprobs=np.zeros(job.batch + 1, np.float32))
    ex.handle(s.on_result(chip, wrong, 1.0))
    assert s.take_notices() == [("inflight_downgraded", 0, "crosstalk")]
    assert s.chips[0].governor.limit() == 1
