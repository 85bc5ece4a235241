"""The sim backend's tensor-parallel latency model: compute / degree + two all-reduces per layer."""

from __future__ import annotations

import pytest

from workers.backends.sim import SimBackend
from workers.backends.sim_latency import LatencyModel


def test_tp_divides_compute_and_adds_two_allreduces_per_layer():
    one = LatencyModel(decode_base_ms=18.0, decode_per_lane_ms=0.5, layers=10, allreduce_us=30.0)
    two = LatencyModel(decode_base_ms=18.0, decode_per_lane_ms=0.5, layers=10, allreduce_us=30.0, tp_degree=2)
    assert one.decode_seconds(16) == pytest.approx((18.0 + 8.0) / 1000)
    assert two.decode_seconds(16) == pytest.approx((18.0 + 8.0) / 2000 + 2 * 10 * 30e-6)
    assert two.prefill_seconds(1000) == pytest.approx(one.prefill_seconds(1000) / 2 + 2 * 10 * 30e-6)
    # Latency wins at low load; the crossover in throughput per chip is the all-reduce's price.
    assert two.decode_seconds(1) < one.decode_seconds(1)
    assert 16 / two.decode_seconds(16) / 2 < 16 / one.decode_seconds(16)
    with pytest.raises(ValueError):
        LatencyModel(tp_degree=0)


def test_sim_backend_takes_the_replica_options():
    b = SimBackend(tp_rank=1, tp_world=4, tp_group="/ignored", layers=8, allreduce_us=10.0, time_scale=0.0)
    assert b.latency.tp_degree == 4 and b.latency.layers == 8
    assert b.describe().extra["latency"]["tp_degree"] == 4


def test_simulate_models_tp_replicas(capsys):
    """`npuserve simulate --chips-per-replica 2`: one replica of two chips, the TP step model."""
    import json

    from tools.simulate import main

    def run(*extra) -> list[dict]:
        assert main(["--policies", "continuous", "--concurrency", "1", "--requests", "6", "--prompt-mean", "64",
                     "--gen-mean", "16", "--chips", "2", "--json", *extra]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    tp, dp = run("--chips-per-replica", "2"), run()
    assert tp[0]["tpot_mean_ms"] < dp[0]["tpot_mean_ms"]  # each step split over two chips
    assert main(["--chips", "3", "--chips-per-replica", "2"]) == 2
