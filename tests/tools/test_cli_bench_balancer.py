"""`npuserve bench-balancer --json` end to end on a tiny workload (a smoke test; targets live in docs)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT

pytestmark = pytest.mark.integration


def test_bench_balancer_reports_its_three_sections():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench-balancer", "--json", "--latency-requests", "10",
                        "--requests", "8", "--gen-tokens", "8", "--concurrency", "4", "--clients", "1",
                        "--rounds", "1", "--prefix-requests", "10"], cwd=ROOT, capture_output=True, timeout=240)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    lines = [orjson.loads(x) for x in p.stdout.splitlines()]
    assert all(next(iter(x)) == "kind" and x["kind"] == "row" for x in lines)  # the --json convention
    rows = {r["section"]: r for r in lines}
    assert set(rows) == {"latency", "throughput", "routing"}
    lat = rows["latency"]
    assert lat["added_p50_ms"] == round(lat["via_p50_ms"] - lat["direct_p50_ms"], 3)
    thr = rows["throughput"]
    assert thr["direct"]["errors"] == thr["via"]["errors"] == 0 and thr["via"]["tokens_per_s"] > 0
    assert set(rows["routing"]) - {"kind", "section"} == {"round-robin", "least-load", "prefix"}
    assert all(0 <= rows["routing"][p]["prefix_hit_rate"] < 1 for p in ("round-robin", "least-load", "prefix"))
