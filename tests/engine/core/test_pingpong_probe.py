"""Ping/pong must pay for itself: delivered tokens/s with two jobs in flight against one (fake clock)."""

from __future__ import annotations

import heapq

from engine.core.inflight_governor import GovernorPolicy, InflightGovernor
from engine.core.pingpong_probe import Phase, PingPongProbe
from engine.core.scheduler_config import SchedulerConfig
from test_scheduler_fakes import FakeExecutor, make_scheduler, params


def _feed(p: PingPongProbe, now: float, rate: float, tokens: int, step: int = 8) -> float:
    """Deliver `tokens` at `rate` tokens/s from `now` in bursts of `step`; the time reached."""
    for _ in range(tokens // step):
        now += step / rate
        p.on_tokens(now, step)
    return now


def test_the_probe_keeps_pingpong_only_at_the_minimum_gain() -> None:
    p = PingPongProbe(min_gain=0.10, window=64, settle=8, warmup=8, hold=2, hold_against=2)
    assert not p.single()  # the configured limit is measured first
    now = _feed(p, 0.0, 1000.0, 64 + 8 + 8)
    assert p.phase is Phase.SINGLE and p.single()
    now = _feed(p, now, 1050.0, 64 + 8 + 8)  # one in flight delivered more: ping/pong costs
    assert p.phase is Phase.HOLD_SINGLE and p.single() and p.gain() < 1.0
    now = _feed(p, now, 1050.0, 2 * 64)  # the hold (2 windows), then measure again at the configured limit
    assert p.phase is Phase.MULTI and not p.single()
    now = _feed(p, now, 1200.0, 64 + 16)
    now = _feed(p, now, 1000.0, 64 + 16)
    assert p.phase is Phase.HOLD_MULTI and not p.single() and p.gain() >= 1.10


def test_a_gain_short_of_the_threshold_does_not_keep_pingpong_and_the_hold_doubles() -> None:
    p = PingPongProbe(min_gain=0.10, window=64, settle=8, warmup=8, hold=2, hold_against=2)
    now = _feed(p, 0.0, 1050.0, 80)
    now = _feed(p, now, 1000.0, 80)  # +5 %: not worth two jobs in flight
    assert p.phase is Phase.HOLD_SINGLE and p.stats()["hold_windows"] == 2
    now = _feed(p, now, 1000.0, 2 * 64)
    now = _feed(p, now, 1050.0, 80)
    now = _feed(p, now, 1000.0, 80)
    assert p.phase is Phase.HOLD_SINGLE and p.stats()["hold_windows"] == 4 and p.verdicts_against == 2


def test_the_governor_takes_the_probes_limit_unless_a_fault_downgraded_it() -> None:
    g = InflightGovernor(GovernorPolicy(max_inflight=2, min_gain=0.10, gain_window=64))
    assert g.limit() == 2
    g.probe.phase = Phase.HOLD_SINGLE
    assert g.limit() == 1
    assert g.reenable() is False and g.limit() == 2  # the re-enable measures again from the configured limit
    assert InflightGovernor(GovernorPolicy(max_inflight=2)).probe is None  # min_gain 0: not measured


class Chip:
    """A fake chip on a fake clock: a job's host side (`host_s`, before the device; two jobs' host sides
    overlap each other and the device) then its device time (one job at a time: `fixed_s` + `lane_s` per
    lane, times `contention` while another job is in flight)."""

    def __init__(self, ex: FakeExecutor, host_s: float, fixed_s: float = 0.008, lane_s: float = 0.0005,
                 contention: float = 1.0) -> None:
        self.ex, self.host_s, self.fixed_s, self.lane_s, self.contention = ex, host_s, fixed_s, lane_s, contention
        self.device_free = 0.0
        self.done: list[tuple[float, int]] = []  # (finish time, job id)
        self.max_inflight_seen = 0

    def run(self, now: float = 0.0) -> float:
        s, ex = self.ex.sched, self.ex
        for _ in range(200_000):
            ex.handle(s.tick(now))
            for chip, job in ex.pending:
                if all(j != job.job_id for _, j in self.done):
                    both = len(s.chips[0].inflight) > 1
                    start = max(now + self.host_s, self.device_free)
                    self.device_free = start + (self.fixed_s + self.lane_s * job.batch) * (
                        self.contention if both else 1.0)
                    heapq.heappush(self.done, (self.device_free, job.job_id))
            self.max_inflight_seen = max(self.max_inflight_seen, len(s.chips[0].inflight))
            if not self.done:
                if not s.has_work():
                    return now
                now += 0.001
                continue
            now, jid = heapq.heappop(self.done)
            idx = next(i for i, (_, j) in enumerate(ex.pending) if j.job_id == jid)
            ex.complete_one(now, idx)
        raise AssertionError("did not finish")


def _serve(max_inflight: int, host_s: float, contention: float = 1.0, min_gain: float = 0.10,
           requests: int = 32, tokens: int = 120) -> tuple[float, Chip]:
    cfg = SchedulerConfig(max_inflight=max_inflight, pingpong_min_gain=min_gain, pingpong_gain_window=128,
                          max_sequences=64, mixed_batches=False)
    ex = FakeExecutor(make_scheduler(cfg))
    for rid in range(1, requests + 1):
        ex.submit(rid, params(max_tokens=tokens, seed=rid))
    chip = Chip(ex, host_s, contention=contention)
    end = chip.run()
    assert len(ex.terminal) == requests
    return requests * tokens / end, chip


def test_with_no_host_side_pingpong_is_turned_off_and_costs_at_most_three_percent() -> None:
    # two jobs in flight only contend for the device (6 % slower each), no host side to hide
    one, _ = _serve(1, host_s=0.0)
    two, chip = _serve(2, host_s=0.0, contention=1.06)
    gov = chip.ex.sched.chips[0].governor
    assert gov.probe.verdicts_against >= 1 and gov.probe.gain() < 1.10
    assert two >= 0.97 * one
    always, _ = _serve(2, host_s=0.0, contention=1.06, min_gain=0.0)  # the probe off: ping/pong all along
    assert always < 0.97 * one  # the loss it avoids is real


def test_with_a_host_side_to_hide_pingpong_stays_on_and_keeps_its_gain() -> None:
    one, _ = _serve(1, host_s=0.010)
    two, chip = _serve(2, host_s=0.010)
    gov = chip.ex.sched.chips[0].governor
    assert gov.probe.gain() >= 1.10 and gov.probe.verdicts_against == 0
    assert chip.max_inflight_seen == 2 and two >= 1.10 * one
