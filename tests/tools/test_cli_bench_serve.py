"""`npuserve bench-serve --json` end to end on a tiny workload (a smoke test; targets live in the README)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT

pytestmark = pytest.mark.integration

KEYS = {"backend", "concurrency", "requests", "errors", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
        "tpot_p50_ms", "tpot_p99_ms", "predicted_tokens_per_s"}


def _bench(*args: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench-serve", "--json", *args], cwd=ROOT,
                       capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    return orjson.loads(p.stdout)


def test_stub_bench_reports_every_field():
    r = _bench("--backend", "stub", "--concurrency", "8", "--requests", "16", "--gen-mean", "32")
    assert KEYS <= set(r)
    assert r["backend"] == "stub" and r["requests"] == 16 and r["errors"] == 0
    assert r["tokens_per_s"] > 0 and r["generated_tokens"] >= 16
    assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["tpot_p50_ms"] <= r["tpot_p99_ms"]
    assert r["predicted_tokens_per_s"] is None


def test_sim_bench_has_a_prediction():
    r = _bench("--backend", "sim", "--concurrency", "4", "--requests", "4", "--gen-mean", "16", "--prompt-mean", "16",
               "--chips", "1", "--clients", "1")
    assert r["errors"] == 0 and r["predicted_tokens_per_s"] > 0


def test_sim_bench_reports_both_runs_for_the_gap_breakdown():
    r = _bench("--backend", "sim", "--concurrency", "4", "--requests", "6", "--gen-mean", "16", "--prompt-mean", "16",
               "--chips", "2", "--clients", "1")
    d, p = r["daemon_run"], r["predicted_run"]
    assert len(d["device_busy"]) == len(p["device_busy"]) == 2
    # Every prompt is one prefill job (16 tokens < one chunk) and each request's other tokens are decode lanes.
    assert d["prefill_jobs"] == p["prefill_jobs"] == 6
    assert d["decode_lanes"] == p["decode_lanes"] == r["generated_tokens"] - 6
    assert sum(d["jobs"]) == d["decode_jobs"] + d["prefill_jobs"]
    assert all(0 < b <= 1.0 for b in d["device_busy"]) and max(p["device_busy"]) > 0.5


def test_simulator_run_summary_matches_its_latency_model():
    from engine.sim import make_workload, simulate
    from tools.load.chip_runs import sim_run
    from workers.backends.sim_latency import LatencyModel

    wl = make_workload(10, 64, 16, seed=7)
    res = simulate("continuous", 4, wl, chips=2)
    run = sim_run(res)
    lat = LatencyModel()
    prompt_tokens = sum(len(w.prompt) for w in wl)
    assert run["prefill_tokens"] == prompt_tokens and run["prefill_jobs"] == 10
    assert run["decode_lanes"] == sum(w.max_tokens for w in wl) - 10
    # Busy time is exactly the latency model over the jobs that ran.
    busy = sum(c["busy_s"] for c in res.per_chip)
    model = (prompt_tokens * lat.flops_per_token / lat.throughput_flops
             + run["decode_jobs"] * lat.decode_base_ms / 1000 + run["decode_lanes"] * lat.decode_per_lane_ms / 1000)
    assert abs(busy - model) < 1e-6
    assert abs(busy - res.chip_busy * res.makespan_s * 2) < 1e-6
    assert abs(sum(run["device_s"]) - busy) < 0.002  # reported rounded to ms


def test_bench_observe_compares_plain_metrics_and_trace():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench-observe", "--json", "--rounds", "1",
                        "--requests", "8", "--concurrency", "4", "--scrape-interval", "0.2"],
                       cwd=ROOT, capture_output=True, timeout=300)
    rows = [orjson.loads(line) for line in p.stdout.splitlines()]
    assert [r["variant"] for r in rows] == ["plain", "metrics", "trace", "in-process"], p.stderr.decode()[-3000:]
    assert all(next(iter(r)) == "kind" for r in rows)  # the --json convention (tools/json_lines.py)
    assert [r["kind"] for r in rows] == ["row", "row", "row", "summary"]
    runs = rows[:3]
    assert all(r["errors"] == 0 and r["tokens_per_s"] > 0 for r in runs), (rows, p.stderr.decode()[-3000:])
    assert runs[0]["ratio_to_plain"] == 1.0 and runs[2]["trace_bytes"] > 0
    assert rows[3]["metrics_us_per_token"] > 0 and rows[3]["trace_us_per_event"] > 0
    # the verdict is the exit status (a timing result: either is possible on a loaded machine)
    assert p.returncode == (0 if all(r["ok"] is not False for r in runs) else 1)
