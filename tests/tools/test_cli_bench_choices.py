"""`npuserve bench serve choices --json`: n = 4 against n = 1 on one ref daemon, paired rounds, the TTFT target
(a smoke test of the plumbing; the figure lives in docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT

pytestmark = pytest.mark.integration


def test_choices_bench_runs_both_sides_and_reports_the_ttft_ratio_with_its_target():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "serve", "choices", "--json", "--rounds", "2",
                        "--requests", "2", "--prompt", "fixed:40", "--output", "fixed:3"],
                       cwd=ROOT, capture_output=True, timeout=900)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    lines = [orjson.loads(x) for x in p.stdout.splitlines()]
    rows = [x for x in lines if x["kind"] == "row"]
    assert sorted((r["label"], r["round"]) for r in rows) == [("n=1", 1), ("n=1", 2), ("n=4", 1), ("n=4", 2)]
    assert all(r["errors"] == 0 and r["requests"] == 2 for r in rows)
    assert {r["label"]: r["generated_tokens"] for r in rows} == {"n=1": 2 * 3, "n=4": 2 * 3 * 4}
    # ref copies blocks: every prompt is computed once, whatever n
    assert all(r["prefill_tokens"] == r["prompt_tokens"] == 80 for r in rows)
    (summary,) = [x for x in lines if x["kind"] == "summary"]
    ttft = next(c for c in summary["comparison"] if c["metric"] == "ttft_p50_ms")
    assert (ttft["subject"], ttft["baseline"], ttft["target"], ttft["bound"]) == ("n=4", "n=1", "<= 1.2x", 1.2)
    assert len(ttft["rounds"]) == 2
