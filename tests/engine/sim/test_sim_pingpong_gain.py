"""Ping/pong on the simulator's virtual chips (virtual clock): it keeps its gain where a host side per step
hides behind the other job, and costs at most 3 % where there is none to hide (it turns itself off)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from engine.core.scheduler_config import SchedulerConfig
from engine.sim.runner import predict
from workers.backends.sim_latency import LatencyModel


@functools.cache
def _tokens_per_s(host_ms: float, max_inflight: int, min_gain: float = 0.10) -> float:
    lat = dataclasses.replace(LatencyModel(), host_ms=host_ms)
    cfg = SchedulerConfig(max_inflight=max_inflight, pingpong_min_gain=min_gain)
    return predict(64, requests=192, prompt_mean=128, gen_mean=192, latency=lat, config=cfg).throughput_tok_s


@pytest.mark.parametrize("host_ms, at_least", [(0.0, 0.97), (4.0, 1.10)])
def test_pingpong_against_one_in_flight(host_ms: float, at_least: float) -> None:
    assert _tokens_per_s(host_ms, 2) >= at_least * _tokens_per_s(host_ms, 1)


def test_without_the_gain_check_pingpong_costs_more_than_three_percent_with_no_host_side() -> None:
    # what the check above guards against: always two jobs in flight with nothing to hide
    assert _tokens_per_s(0.0, 2, min_gain=0.0) < 0.97 * _tokens_per_s(0.0, 1)
