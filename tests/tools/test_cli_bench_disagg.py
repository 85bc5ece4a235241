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
