"""`npuserve bench-peer` end to end on the tiny GGUF model (the mechanics; Gemma numbers are in docs/models.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from repo_root import ROOT
from workers.default_package import ensure_default_gguf_package


def test_bench_peer_prints_rows_for_both_engines_and_ratios():
    pkg = ensure_default_gguf_package()
    r = subprocess.run([sys.executable, "-m", "tools.cli", "bench-peer", "--package", pkg, "--concurrency", "2",
                        "--rounds", "1", "--output-tokens", "4", "--prompt-tokens", "16", "--system-tokens", "32",
                        "--shared-prefix", "--threads", "1", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert all(next(iter(x)) == "kind" for x in lines)  # the --json convention (tools/json_lines.py)
    rows = [x for x in lines if "engine" in x]
    ratios = [x for x in lines if "ratio" in x]
    assert {x["kind"] for x in rows} == {"row"} and {x["kind"] for x in ratios} == {"ratio"}
    assert sorted((x["engine"], x["workload"]) for x in rows) == [
        ("llama.cpp", "plain"), ("llama.cpp", "shared-prefix"), ("npuserve", "plain"), ("npuserve", "shared-prefix")]
    for x in rows:
        assert x["concurrency"] == 2 and x["tokens_per_s"] > 0 and 0 < x["ttft_p50_ms"] <= x["ttft_p99_ms"]
    assert {x["ratio"] for x in ratios} == {"tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"}
    assert all(x["npuserve_over_llama_cpp"] > 0 for x in ratios)


def test_ratios_carry_each_rounds_paired_ratio_and_flag_a_bound_inside_their_spread():
    from tools.bench.serve.peer import Row, format_table, ratio_rows

    def row(engine, rnd, tok_s, ttft_p99):
        return Row(engine, 32, "plain", tok_s, 500.0, ttft_p99, 100.0, 110.0, rnd)

    rows = [row("npuserve", 0, 100.0, 1000.0), row("llama.cpp", 0, 100.0, 900.0),
            row("llama.cpp", 1, 100.0, 950.0), row("npuserve", 1, 96.0, 1000.0),
            row("npuserve", 2, 103.0, 1000.0), row("llama.cpp", 2, 100.0, 980.0)]
    ratios = {x["ratio"]: x for x in ratio_rows(rows)}
    tok = ratios["tokens_per_s"]
    assert tok["npuserve_over_llama_cpp"] == 1.0 and tok["round_ratios"] == [1.0, 0.96, 1.03]
    assert tok["met"] is True and tok["within_spread"] is True  # 0.96 <= 1.0 <= 1.03: a coin flip between runs
    ttft = ratios["ttft_p99_ms"]
    assert ttft["npuserve_over_llama_cpp"] == round(1000 / 950, 3) and ttft["distance"] == 0.053
    assert ttft["round_ratios"] == [1.111, 1.053, 1.02]
    assert ttft["met"] is False and ttft["within_spread"] is False  # every round above the bound: a real miss
    assert "within_spread" not in ratios["tpot_p50_ms"]  # no target there
    text = format_table(rows, list(ratios.values()))
    tok_line = next(x for x in text.splitlines() if "tokens_per_s" in x)
    assert "[0.960-1.030]" in tok_line and "met" in tok_line and "parity" in tok_line
    ttft_line = next(x for x in text.splitlines() if "ttft_p99_ms" in x)
    assert "MISSED by 0.053" in ttft_line and "parity" not in ttft_line
