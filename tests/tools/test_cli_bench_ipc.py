"""`npuserve bench-ipc` end to end (smoke): every transport at every payload size, as JSON Lines
(the CLI's convention: rows, then a summary of the targets)."""

from __future__ import annotations

import subprocess
import sys

import orjson

from repo_root import ROOT


def test_bench_ipc_json_lines_rows_cover_every_transport_and_size_then_summary():
    from tools.bench.micro.ipc import PAYLOADS

    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench-ipc", "--json", "--iters", "10"], cwd=ROOT,
                       capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    objs = [orjson.loads(line) for line in p.stdout.splitlines()]
    rows, summary = objs[:-1], objs[-1]
    assert rows and all(r["kind"] == "row" for r in rows)
    transports = {(r["transport"], r["doorbell"]) for r in rows}
    assert {("shm-ring", "semaphore"), ("shm-ring", "zmq"), ("zmq-copy", None), ("memcpy", None)} <= transports
    assert {((r["transport"], r["doorbell"]), r["payload_bytes"]) for r in rows} == \
        {(t, size) for t in transports for size in PAYLOADS}
    assert all(0 < r["p50_us"] <= r["p99_us"] for r in rows)
    assert summary["kind"] == "summary"
    ring = [r for r in rows if r["transport"] == "shm-ring" and r["doorbell"] == "semaphore"
            and r["payload_bytes"] == summary["small_payload_bytes"]]
    assert summary["small_ring_p50_us"] == ring[0]["p50_us"]
    assert summary["small_ring_p50_ok"] == (ring[0]["p50_us"] < 30)


def test_bench_ipc_refuses_too_few_iterations_with_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "tools.cli", "bench-ipc", "--iters", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--iters must be at least 10" in out.stderr
