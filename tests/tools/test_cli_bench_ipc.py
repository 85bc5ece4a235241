"""`npuserve bench-ipc` end to end (smoke): every transport at every payload size, one JSON row per line."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_bench_ipc_json_rows_cover_every_transport_and_size():
    from tools.bench_ipc import PAYLOADS

    out = subprocess.run([sys.executable, "-m", "tools.cli", "bench-ipc", "--json", "--iters", "10"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert all(isinstance(r, dict) for r in rows)
    transports = {(r["transport"], r["doorbell"]) for r in rows}
    assert {("shm-ring", "semaphore"), ("shm-ring", "zmq"), ("zmq-copy", None)} <= transports
    assert {((r["transport"], r["doorbell"]), r["payload_bytes"]) for r in rows} == \
        {(t, size) for t in transports for size in PAYLOADS}
    assert all(0 < r["p50_us"] <= r["p99_us"] for r in rows)


def test_bench_ipc_refuses_too_few_iterations_with_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "tools.cli", "bench-ipc", "--iters", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--iters must be at least 10" in out.stderr
