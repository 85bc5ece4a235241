"""`npuserve bench` end to end against a stub daemon it starts: sweep, SLO, tenants, prefixes, plot, open loop."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT

pytestmark = pytest.mark.integration


def _bench(*args: str) -> list[dict]:
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "--json", "--no-progress", *args], cwd=ROOT,
                       capture_output=True, timeout=240)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    return [orjson.loads(line) for line in p.stdout.splitlines()]


def test_closed_loop_sweep_with_slo_tenants_prefixes_and_plot(tmp_path):
    png = tmp_path / "pareto.png"
    out = _bench("--backend", "stub", "--chips", "1", "--sweep", "2,4", "--per-slot", "4", "--prompt", "uniform:40,60",
                 "--output", "heavy:8,0.8", "--slo", "ttft=120s,tpot=30s", "--tenants", "a:3,b:1", "--prefixes", "2",
                 "--prefix-len", "32", "--plot", str(png))
    rows, summary = out[:-1], out[-1]
    assert [r["kind"] for r in rows] == ["row", "row"] and summary["kind"] == "summary"
    assert [r["concurrency"] for r in rows] == [2, 4] and [r["requests"] for r in rows] == [8, 16]
    for r in rows:
        assert r["errors"] == 0 and r["tokens_per_s"] > 0 and r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        # An SLO no run inside this test's time limit can miss, however loaded the machine: what is checked
        # is the accounting (every request counted as met, goodput = throughput), not the machine's speed.
        assert r["slo_met"] == r["requests"]
        assert r["goodput_tokens_per_s"] == r["tokens_per_s"]
        assert set(r["tenants"]) <= {"a", "b"} and sum(t["requests"] for t in r["tenants"].values()) == r["requests"]
        # Shared prefixes: two 32-token system prompts = 2 full blocks each, reused by the later requests.
        assert r["daemon_run"]["prefill_tokens"] < 35 * r["requests"]  # ~50 per prompt without the cache
        assert isinstance(r["pareto"], bool)
    assert any(r["pareto"] for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_open_loop_rate():
    out = _bench("--backend", "stub", "--chips", "1", "--rate", "40", "--requests", "40", "--prompt", "fixed:8",
                 "--output", "fixed:4", "--clients", "1")
    row = out[0]
    assert row["rate"] == 40 and row["concurrency"] is None and row["requests"] == 40 and row["errors"] == 0
    # Arrivals spread over ~1 s (Poisson at 40/s), so the run cannot be much shorter than that.
    assert row["seconds"] > 0.5
    assert row["generated_tokens"] == 160


def test_bad_arguments_say_what_to_do():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "--prompt", "pareto:1"], cwd=ROOT,
                       capture_output=True, timeout=60)
    assert p.returncode == 2 and b"fixed, uniform, normal, heavy" in p.stderr
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "--prefixes", "3"], cwd=ROOT,
                       capture_output=True, timeout=60)
    assert p.returncode == 2 and b"--prefix-len" in p.stderr
