"""Load report: SLO parsing and goodput, percentiles, the Pareto frontier, the bench comparison."""

from __future__ import annotations

import pytest

from tools.bench.serve.load import compare
from tools.load.report import Slo, pareto, summarize
from tools.load.runner import Record


def _rec(i, ttft_ms, tokens, tpot_ms, error=None, tenant="default"):
    first = 100.0 + ttft_ms / 1000
    return Record(i, tenant, 100.0, None if error else first, None if error else first + tpot_ms * (tokens - 1) / 1000,
                  0 if error else tokens, error)


def test_slo_parse():
    assert Slo.parse("ttft=500ms,tpot=25ms") == Slo(500.0, 25.0)
    assert Slo.parse("ttft=0.5s") == Slo(500.0, None)
    for bad in ("ttft=", "latency=5ms", "ttft=fast"):
        with pytest.raises(ValueError):
            Slo.parse(bad)


def test_goodput_counts_only_requests_meeting_the_slo():
    recs = [_rec(0, 100, 11, 10), _rec(1, 900, 11, 10), _rec(2, 100, 11, 40), _rec(3, 0, 0, 0, error=504)]
    row = summarize(recs, Slo(500, 25))
    assert row["requests"] == 4 and row["errors"] == 1 and row["error_codes"] == {"504": 1}
    assert row["slo_met"] == 1
    window = row["seconds"]
    assert row["goodput_requests_per_s"] == pytest.approx(1 / window, rel=1e-2)
    assert row["goodput_tokens_per_s"] == pytest.approx(11 / window, rel=1e-2)
    assert row["tokens_per_s"] == pytest.approx(33 / window, rel=1e-2)
    assert row["ttft_p99_ms"] == pytest.approx(900, abs=0.01)


def test_per_tenant_rows():
    recs = [_rec(i, 10 * (i + 1), 5, 2, tenant="a" if i % 2 else "b") for i in range(6)]
    row = summarize(recs)
    assert set(row["tenants"]) == {"a", "b"} and row["tenants"]["a"]["requests"] == 3


def test_pareto_frontier():
    rows = [{"ttft_p99_ms": 100, "tokens_per_s": 10}, {"ttft_p99_ms": 200, "tokens_per_s": 30},
            {"ttft_p99_ms": 300, "tokens_per_s": 25}, {"ttft_p99_ms": 400, "tokens_per_s": 30},
            {"ttft_p99_ms": 500, "tokens_per_s": 40}, {"ttft_p99_ms": None, "tokens_per_s": 99}]
    assert [r["ttft_p99_ms"] for r in pareto(rows)] == [100, 200, 500]


def test_compare_at_the_same_ttft_budget():
    rows = [{"label": "cont", "concurrency": c, "ttft_p99_ms": t, "tokens_per_s": v}
            for c, t, v in [(8, 100, 300), (16, 250, 500), (32, 900, 600)]]
    rows += [{"label": "static", "concurrency": c, "ttft_p99_ms": t, "tokens_per_s": v}
             for c, t, v in [(8, 300, 150), (16, 1000, 200)]]
    out = compare(rows)
    assert [(c["ttft_p99_budget_ms"], c["tokens_per_s"], c["baseline_tokens_per_s"], c["ratio"]) for c in out] == [
        (300, 500, 150, 3.33), (1000, 600, 200, 3.0)]
