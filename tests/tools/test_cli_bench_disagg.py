"""bench-disagg's pure parts: the verdict at the co-located break point, fresh prompts per side, its flags."""

from __future__ import annotations

import pytest

from tools.bench.serve.disagg import fresh_prompts, parse_args, verdict
from tools.load.report import Slo
from tools.load.workload import Request


def row(label, rate, tpot_p99, good):
    return {"label": label, "rate": rate, "tpot_p99_ms": tpot_p99, "goodput_requests_per_s": good}


def test_the_verdict_is_taken_where_co_located_tpot_first_breaks_the_slo():
    rows = [row("disaggregated", 1, 30, 1.0), row("co-located", 1, 35, 1.0),
            row("co-located", 2, 45, 1.0), row("disaggregated", 2, 38, 1.5),
            row("disaggregated", 4, 60, 0.5), row("co-located", 4, 90, 0.2)]
    v = verdict(rows, Slo(tpot_ms=40))
    assert v["co_located_tpot_breaks_at_rate"] == 2 and v["goodput_ratio_there"] == 1.5 and v["met"] is True
    assert v["goodput_ratio_by_rate"] == {"1": 1.0, "2": 1.5, "4": 2.5}
    v = verdict(rows[:2], Slo(tpot_ms=40))
    assert v["co_located_tpot_breaks_at_rate"] is None and v["met"] is None


def test_each_side_gets_the_same_lengths_and_times_with_other_tokens():
    reqs = [Request(i, [5] * (10 + i), 8, seed=i, at=0.5 * i) for i in range(4)]
    a, b = fresh_prompts(reqs, 1), fresh_prompts(reqs, 2)
    assert [len(r.prompt) for r in a] == [len(r.prompt) for r in reqs] == [len(r.prompt) for r in b]
    assert [r.at for r in a] == [r.at for r in reqs] and a[0].prompt != b[0].prompt


def test_flags():
    a = parse_args(["--rates", "1,2.5", "--transfer", "none", "--slo", "tpot=30ms"])
    assert a.rate_list == [1.0, 2.5] and a.transfer == "none" and a.slo_obj.tpot_ms == 30
    assert parse_args(["--transfer", "zmq"]).transfer == "zmq"
    with pytest.raises(SystemExit):
        parse_args(["--rates", "0"])


def test_the_cost_model_takes_the_sim_options_of_the_run():
    a = parse_args(["--backend-option", "flops_per_token=1e11", "--backend-option", "time_scale=0.5",
                    "--max-inflight", "1"])
    assert a.costs.prefill_s_per_token == pytest.approx(1e11 / 312e12 * 0.5)
    assert a.costs.decode_base_s == pytest.approx(0.018 * 0.5) and a.costs.inflight == 1
    assert a.costs.import_s_per_block == pytest.approx((2 << 20) / 25e9 * 0.5)
    # the sim's defaults: an import of a 16-token block (84 us) is cheaper than computing it (718 us) from the
    # first full block before the last token, so the disaggregated balancer hands off prompts of 17 tokens on
    assert parse_args([]).pd_min_prompt == 17 and parse_args(["--pd-min-prompt", "0"]).pd_min_prompt == 0
    with pytest.raises(SystemExit):
        parse_args(["--pd-min-prompt", "-1"])


def test_the_verdict_is_printed_beside_the_cost_models_bound():
    from tools.bench.serve.disagg import limits

    a = parse_args(["--max-inflight", "1"])
    rows = [row("co-located", 4.0, 41, 2.8), row("disaggregated", 4.0, 30, 2.9)]
    v = verdict(rows, Slo(tpot_ms=40))
    measured, model = limits(rows, v, a)
    assert model.figure == v["goodput_ratio_there"] == measured.figure and model.target == ">= 1.3x"
    met = model.inputs["model_co_located_met"]
    assert 0 < met < 1 and model.bound == pytest.approx(1 / met, abs=1e-3) and model.inputs["rate"] == 4.0
    # no measured break point: the model's own (one job in flight: none before co-location saturates)
    (_, model) = limits([row("co-located", 1.0, 30, 1.0)], verdict([row("co-located", 1.0, 30, 1.0)],
                                                                    Slo(tpot_ms=40)), a)
    assert model.bound is None and "no break point" in model.limited_by
