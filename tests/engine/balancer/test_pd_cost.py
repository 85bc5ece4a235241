"""The disaggregation cost model (engine/balancer/pd_cost.py) against cases worked out by hand."""

from __future__ import annotations

import math

import pytest

from engine.balancer.pd_cost import (Costs, Load, colocated, compare, decode_interval, disaggregated,
                                     min_split_prompt, poisson_cdf, split_pays, ttft_met)
from workers.backends.sim_latency import LatencyModel

# 1 ms per prompt token, 10 ms per decode job whatever its lanes, 4-token blocks imported at 1 ms + 2 ms each
EASY = Costs(prefill_s_per_token=0.001, decode_base_s=0.010, decode_per_lane_s=0.0, import_base_s=0.001,
             import_s_per_block=0.002, block_size=4)


def test_a_decode_leg_imports_the_blocks_before_the_last_token_and_computes_the_rest():
    # 10 tokens: blocks (10 - 1) // 4 = 2 imported (1 + 2 x 2 ms), tokens 9, 10 and the streamed one computed
    assert EASY.import_s(10) == pytest.approx(0.001 + 2 * 0.002 + 3 * 0.001)
    # 4 tokens: no full block before the last token, so all 4 and the streamed one are computed (5 ms > 4)
    assert EASY.import_s(4) == pytest.approx(0.005)
    assert not split_pays(EASY, 4) and split_pays(EASY, 10)


def test_the_shortest_prompt_a_hand_off_pays_for():
    # L = 4k + j (j = 1..4): import 1 + 2k + (j + 1) ms against L = 4k + j ms: pays iff 2 < 2k, so from k = 2, L = 9
    assert min_split_prompt(EASY) == 9
    # an import dearer per block than recomputing its 4 tokens never pays
    assert min_split_prompt(Costs(0.001, 0.010, 0.0, import_s_per_block=0.005, block_size=4)) is None


def test_poisson_cdf_and_the_ttft_queue():
    assert poisson_cdf(2, 1.0) == pytest.approx(2.5 / math.e)
    # rho = 5 x 0.1 = 0.5: 1 - 0.5 exp(-2 x 0.5 x (0.3 - 0.1) / 0.1)
    assert ttft_met(0.1, 5.0, 0.3) == pytest.approx(1 - 0.5 * math.exp(-2.0))
    assert ttft_met(0.1, 10.0, 5.0) == 0.0  # rho 1: the queue grows without bound
    assert ttft_met(0.1, 1.0, 0.05) == 0.0  # the prompt alone takes longer than the SLO


def test_the_decode_interval_is_the_fixed_point_of_littles_law():
    c = Costs(0.001, 0.010, 0.001)
    # T = (0.010 + 0.001 b) / (1 - 2 x 0.1), b = 2 x 10 x T  =>  0.8 T = 0.010 + 0.02 T  =>  T = 0.010 / 0.78
    t, b = decode_interval(c, 2.0, 11, 0.1)
    assert t == pytest.approx(0.010 / 0.78) and b == pytest.approx(20 * 0.010 / 0.78)
    assert decode_interval(c, 10.0, 11, 0.1) is None  # the stalls alone fill the board


def test_a_round_of_decode_jobs():
    c = Costs(0.001, 0.010, 0.001, inflight=2, max_lanes=16)
    # 3 other streams on average: a stream is alone (one job a round) with P(N = 0) = e^-3, else 2 jobs
    assert c.round_s(3) == pytest.approx((1 * math.exp(-3) + 2 * (1 - math.exp(-3))) * 0.010 + 3 * 0.001)
    assert c.round_s(40) == pytest.approx(40 / 16 * 0.010 + 40 * 0.001)  # 40 streams: 2.5 jobs of 16 lanes
    assert Costs(0.001, 0.010, 0.001).round_s(3) == pytest.approx(0.010 + 0.003)


def test_co_located_goodput_by_hand():
    load = Load(2.0, 100, 11, 1.0, 0.025)  # 1 request/s on each of 2 boards
    p = colocated(EASY, load, boards=2)
    # each prompt stalls the board 0.1 s: T = 0.010 / (1 - 0.1), mu = 1 x 10 x T others' prompts in a stream's
    # life; TPOT met while 10 x (0.025 - 0.010) >= K x 0.1, i.e. K <= 1
    mu = 10 * 0.010 / 0.9
    assert p.tpot_met == pytest.approx(math.exp(-mu) * (1 + mu))
    # TTFT: 100 / 512 chunks, 8 / 4 decode jobs of 10 ms after each while streams run (1 - e^-b, b = mu)
    service = 0.1 + (100 / 512) * 2 * 0.010 * (1 - math.exp(-mu))
    assert p.ttft_s == pytest.approx(service)
    ttft = 1 - service * math.exp(-2 * (1 - service) * (1.0 - service) / service)
    assert p.goodput == pytest.approx(2.0 * ttft * math.exp(-mu) * (1 + mu))
    assert p.stable


def test_disaggregated_goodput_by_hand():
    load = Load(2.0, 100, 11, 1.0, 0.025)
    p = disaggregated(EASY, load, 1, 1)
    # decode leg: 24 blocks (1 + 48 ms) and 5 tokens computed: 54 ms, its own before its 2nd token and a stall
    # of every other stream; T = 0.010 / (1 - 2 x 0.054), mu = 2 x 10 x T; met while 0.15 - 0.054 >= K x 0.054
    mu = 20 * 0.010 / (1 - 0.108)
    assert p.tpot_met == pytest.approx(math.exp(-mu) * (1 + mu))
    assert p.tpot_mean_s == pytest.approx(0.010 + (0.054 + mu * 0.054) / 10)
    # TTFT: the prefill board alone, 0.1 s per prompt at 2/s (rho 0.2)
    ttft = 1 - 0.2 * math.exp(-2 * 0.8 * 0.9 / 0.1)
    assert p.ttft_met == pytest.approx(ttft)
    assert p.goodput == pytest.approx(2.0 * ttft * math.exp(-mu) * (1 + mu))


def test_on_two_sim_boards_long_prompts_win_split_and_short_ones_co_located():
    sim = Costs.from_sim(LatencyModel())  # 44.9 us a prompt token, 18 ms + 0.12 ms a lane per decode job
    assert sim.prefill_s_per_token == pytest.approx(14e9 / 312e12)
    assert sim.import_s_per_block == pytest.approx((2 << 20) / 25e9)
    long = compare(sim, Load(4.0, 1536, 64, 1.0, 0.040))
    short = compare(sim, Load(4.0, 64, 64, 1.0, 0.040))
    assert long["capacity_ratio"] > 1.3 and short["capacity_ratio"] < 1.0
    assert 64 < long["min_winning_prompt"] <= 1536
