"""`npuserve bench-serve --compare-framing --json`: both client framings against one daemon, paired rounds,
the comparison with its target (a smoke test of the plumbing; the figure lives in docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT

pytestmark = pytest.mark.integration


def test_compare_framing_runs_both_framings_and_reports_the_ratio_with_its_target():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench-serve", "--json", "--compare-framing", "--backend",
                        "stub", "--concurrency", "4", "--requests", "8", "--gen-mean", "16", "--rounds", "2",
                        "--clients", "1"], cwd=ROOT, capture_output=True, timeout=900)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    lines = [orjson.loads(x) for x in p.stdout.splitlines()]
    rows = [x for x in lines if x["kind"] == "row"]
    assert sorted((r["label"], r["round"]) for r in rows) == [
        ("batched", 1), ("batched", 2), ("one_per_message", 1), ("one_per_message", 2)]
    assert all(r["errors"] == 0 and r["requests"] == 8 and r["daemon_cpu_us_per_token"] > 0 for r in rows)
    (summary,) = [x for x in lines if x["kind"] == "summary"]
    by_metric = {c["metric"]: c for c in summary["comparison"]}
    tps = by_metric["tokens_per_s"]
    assert (tps["subject"], tps["baseline"], tps["target"]) == ("batched", "one_per_message", ">= 1x")
    assert "daemon_cpu_us_per_token" in by_metric
