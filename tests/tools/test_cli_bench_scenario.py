"""`npuserve bench --scenario NAME --quick` end to end against a stub daemon it starts: the plumbing of each
scenario (requests sent as scheduled, records, metrics, targets in the output). The figures themselves are
the benchmark's (docs/benchmarks.md), not asserted here."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from repo_root import ROOT

pytestmark = pytest.mark.integration


def _scenario(name: str, *args: str) -> tuple[list[dict], list[dict], dict]:
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "--scenario", name, "--quick", "--backend", "stub",
                        "--chips", "1", "--json", "--no-progress", *args], cwd=ROOT, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    lines = [orjson.loads(line) for line in p.stdout.splitlines()]
    rows = [x for x in lines if x["kind"] == "row"]
    targets = [x for x in lines if x["kind"] == "target"]
    (summary,) = [x for x in lines if x["kind"] == "summary"]
    assert summary["scenario"] == name and summary["options"]
    return rows, targets, summary


def test_long_prompt(tmp_path):
    png = tmp_path / "timeline.png"
    # the streams run until the long prompt is done, which goes once they are generating: covered at any speed
    (row,), targets, _ = _scenario("long-prompt", "--plot", str(png), "--records", str(tmp_path / "r.jsonl"))
    assert row["errors"] == 0 and row["streams_cover_window"]
    assert row["worst_gap_ms"] >= row["gap_p50_outside_ms"] > 0 and row["long_ttft_max_ms"] > 0
    assert [t["metric"] for t in targets] == ["worst_gap_ms", "long_ttft_max_ms"]
    assert all(t["met"] is None and "bench-http-peer" in t["note"] for t in targets)  # a ratio needs the peer
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recs = [orjson.loads(x) for x in (tmp_path / "r.jsonl").read_bytes().splitlines()]
    assert len(recs) == row["requests"] and {r["role"] for r in recs} == {"stream", "long"}


def test_tenant_flood(tmp_path):
    png = tmp_path / "cdf.png"
    (row,), _, _ = _scenario("tenant-flood", "--plot", str(png), "--scenario-option", "b_requests=3")
    assert row["errors"] == 0 and row["b_requests"] == 3 and len(row["b_ttft_ms"]) == 3
    assert row["a_tokens_per_s"] > 0 and row["requests"] > 3  # the flood ran alongside b, then stopped
    assert png.stat().st_size > 5_000


def test_burst_states_its_slo():
    (row,), (target,), summary = _scenario("burst", "--scenario-option", "ttft_ms=60000",
                                           "--scenario-option", "tpot_ms=60000")
    assert summary["slo"] == "ttft=60000ms,tpot=60000ms"
    assert row["rejected_429"] == 0 and row["slo_met"] == row["requests"] and row["goodput_requests_per_s"] > 0
    assert target["metric"] == "goodput_requests_per_s"


def test_hangups_count_the_servers_tokens_against_the_clients():
    (row,), (target,), _ = _scenario("hangups")
    assert row["errors"] == 0 and row["disconnects"] == row["requests"] // 2
    assert row["server_generated_tokens"] >= row["delivered_tokens"] > 0
    assert target["target_kind"] == "max" and target["value"] == row["wasted_per_disconnect"]


def test_scenario_arguments_are_checked():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "--scenario", "multi-turn"], cwd=ROOT,
                       capture_output=True, timeout=60)
    assert p.returncode == 2 and b"--conversations" in p.stderr
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench", "--scenario", "burst", "--sweep", "2,4"], cwd=ROOT,
                       capture_output=True, timeout=60)
    assert p.returncode == 2 and b"no --variant, --sweep or --rate" in p.stderr


@pytest.mark.integration
def test_bench_http_peer_scenario_runs_both_servers_and_counts_their_tokens(gemma_package):
    """The peer path of a scenario: npuserve (daemon + front) and llama.cpp's server, the same requests, each
    server's own count of the tokens it generated (daemon stats, llama.cpp's /metrics), a ratio per target."""
    opts = ["streams=2", "per_stream=2", "prompt=8", "output=12", "hangup_min=2", "hangup_max=4"]
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench-http-peer", "--scenario", "hangups", "--package",
                        gemma_package, "--threads", "1", "--slots", "2", "--rounds", "1", "--json", "--no-progress",
                        *[x for o in opts for x in ("--scenario-option", o)]], cwd=ROOT, capture_output=True,
                       timeout=400)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    lines = [orjson.loads(line) for line in p.stdout.splitlines()]
    rows = [x for x in lines if x["kind"] == "row"]
    assert sorted(r["label"] for r in rows) == ["llama.cpp", "npuserve"]
    for r in rows:
        assert r["errors"] == 0 and r["disconnects"] == 2
        assert r["server_generated_tokens"] is not None and r["server_generated_tokens"] >= r["delivered_tokens"]
    targets = [x for x in lines if x["kind"] == "target"]
    assert sorted(t["subject"] for t in targets) == ["llama.cpp", "npuserve"]  # an absolute bound: each side
