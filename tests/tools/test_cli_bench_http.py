"""`npuserve bench-http` and `bench-http-peer` end to end (real daemon, real HTTP front, llama.cpp's real server),
and the paired-rounds comparison they print."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT
from tools.load.paired import Target, compare, format_comparison, run_rounds
from tools.load.runner import Record


def _cli(*args: str) -> tuple[list[dict], dict]:
    p = subprocess.run([sys.executable, "-m", "tools.cli", *args, "--json", "--no-progress"], cwd=ROOT,
                       capture_output=True, timeout=400)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    out = [orjson.loads(line) for line in p.stdout.splitlines()]
    assert [o["kind"] for o in out] == ["row"] * (len(out) - 1) + ["summary"]
    return out[:-1], out[-1]


def _rows(label, tok_s, ttft):
    return [{"label": label, "round": i + 1, "tokens_per_s": t, "ttft_p50_ms": f} for i, (t, f) in
            enumerate(zip(tok_s, ttft))]


def test_compare_takes_medians_ratios_and_target_margins():
    rows = _rows("http", [60, 70, 90], [12.0, 13.0, 40.0]) + _rows("zeromq", [100, 100, 100], [10.0, 10.5, 11.0])
    cmp = {c["metric"]: c for c in compare(rows, "http", "zeromq", [Target("tokens_per_s", "min", 0.6),
                                                                      Target("ttft_p50_ms", "diff", 2.0)])}
    assert set(cmp) == {"tokens_per_s", "ttft_p50_ms"}  # metrics no row has are left out
    t = cmp["tokens_per_s"]
    assert (t["subject_median"], t["baseline_median"], t["ratio"]) == (70, 100, 0.7)
    assert t["met"] is True and t["margin"] == pytest.approx(0.1)
    f = cmp["ttft_p50_ms"]
    assert f["difference"] == 2.5 and f["met"] is False and f["margin"] == pytest.approx(-0.5)
    # each round's own paired value, and whether the bound lies inside their spread
    assert t["rounds"] == [0.6, 0.7, 0.9] and t["within_spread"] is True
    assert f["rounds"] == [2.0, 2.5, 29.0] and f["within_spread"] is True
    text = format_comparison(list(cmp.values()))
    assert "rounds 0.600-0.900, the bound inside their spread" in text and "rounds +2.000 to +29.000" in text
    apart = _rows("http", [70, 70, 90], [13.0, 13.0, 40.0]) + _rows("zeromq", [100, 100, 100], [10.0, 10.5, 11.0])
    cmp = {c["metric"]: c for c in compare(apart, "http", "zeromq", [Target("tokens_per_s", "min", 0.6),
                                                                       Target("ttft_p50_ms", "diff", 2.0)])}
    assert cmp["tokens_per_s"]["within_spread"] is False and cmp["ttft_p50_ms"]["within_spread"] is False
    assert "inside" not in format_comparison(list(cmp.values()))
    # a ratio bound on TTFT: 13 / 10.5 = 1.238
    assert [c["met"] for b in (1.25, 1.2) for c in compare(rows, "http", "zeromq", [Target("ttft_p50_ms", "max", b)])
            if "met" in c] == [True, False]


def test_rounds_alternate_the_order_and_share_the_requests():
    seen = []

    def route(name):
        def go(reqs):
            seen.append((name, tuple(reqs)))
            return [Record(0, "default", 0.0, 0.1, 0.2, 2, None)]
        return go

    rows = run_rounds({"a": route("a"), "b": route("b")}, lambda rnd: [rnd], 3)
    assert [(r["label"], r["round"]) for r in rows] == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3), ("b", 3)]
    assert [s[1] for s in seen] == [(0,), (0,), (1,), (1,), (2,), (2,)]


@pytest.mark.integration
def test_bench_http_stub_front_against_zeromq():
    rows, summary = _cli("bench-http", "--backend", "stub", "--chips", "1", "--concurrency", "4", "--requests", "12",
                         "--prompt", "fixed:16", "--output", "fixed:10", "--rounds", "2", "--clients", "1")
    assert sorted((r["label"], r["round"]) for r in rows) == [("http", 1), ("http", 2), ("zeromq", 1), ("zeromq", 2)]
    for r in rows:  # the same requests both ways; ignore_eos: every token the workload asked for, counted by usage
        assert r["errors"] == 0 and r["requests"] == 12 and r["generated_tokens"] == 120
        assert r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] is not None
    by = {c["metric"]: c for c in summary["comparison"]}
    assert by["tokens_per_s"]["target"] == ">= 0.6x" and isinstance(by["tokens_per_s"]["met"], bool)
    assert by["ttft_p50_ms"]["target_kind"] == "diff" and by["ttft_p50_ms"]["bound"] == 2.0
    assert isinstance(summary["targets_met"], bool)


@pytest.mark.integration
def test_bench_http_peer_runs_both_engines_on_the_same_requests(gemma_package):
    rows, summary = _cli("bench-http-peer", "--package", gemma_package, "--threads", "1", "--concurrency", "2",
                         "--per-stream", "1", "--prompt", "fixed:16", "--output", "fixed:4", "--rounds", "1")
    assert sorted(r["label"] for r in rows) == ["llama.cpp", "npuserve"]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 2 and r["generated_tokens"] == 8 and r["concurrency"] == 2
    by = {c["metric"]: c for c in summary["comparison"]}
    assert by["tokens_per_s"]["target"] == ">= 1x" and by["ttft_p99_ms"]["target"] == "<= 1x"
