"""`npuserve bench-serve --json` end to end on a tiny workload (a smoke test; targets live in the README)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from conftest import ROOT

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
