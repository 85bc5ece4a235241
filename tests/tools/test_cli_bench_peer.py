"""`npuserve bench-peer` end to end on the tiny GGUF model (the mechanics; Gemma numbers are in docs/models.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT
from workers.tiny_gguf_package import ensure_default_gguf_package


def test_bench_peer_prints_rows_for_both_engines_and_ratios():
    pkg = ensure_default_gguf_package()
    r = subprocess.run([sys.executable, "-m", "tools.cli", "bench-peer", "--package", pkg, "--concurrency", "2",
                        "--rounds", "1", "--output-tokens", "4", "--prompt-tokens", "16", "--system-tokens", "32",
                        "--shared-prefix", "--threads", "1", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    rows = [x for x in lines if "engine" in x]
    ratios = [x for x in lines if "ratio" in x]
    assert sorted((x["engine"], x["workload"]) for x in rows) == [
        ("llama.cpp", "plain"), ("llama.cpp", "shared-prefix"), ("npuserve", "plain"), ("npuserve", "shared-prefix")]
    for x in rows:
        assert x["concurrency"] == 2 and x["tokens_per_s"] > 0 and 0 < x["ttft_p50_ms"] <= x["ttft_p99_ms"]
    assert {x["ratio"] for x in ratios} == {"tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"}
    assert all(x["npuserve_over_llama_cpp"] > 0 for x in ratios)
