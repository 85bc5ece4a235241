"""`npuserve bench-ipc --json` follows the CLI's JSON Lines convention: rows, then a summary of the targets."""

from __future__ import annotations

import subprocess
import sys

import orjson

from conftest import ROOT


def test_bench_ipc_json_lines_rows_then_summary():
    p = subprocess.run([sys.executable, "-m", "tools.cli", "bench-ipc", "--json", "--iters", "10"], cwd=ROOT,
                       capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    objs = [orjson.loads(line) for line in p.stdout.splitlines()]
    rows, summary = objs[:-1], objs[-1]
    assert rows and all(r["kind"] == "row" for r in rows)
    assert {r["transport"] for r in rows} >= {"shm-ring", "zmq-copy", "memcpy"}
    assert all(r["p50_us"] > 0 and r["p99_us"] >= r["p50_us"] for r in rows)
    assert summary["kind"] == "summary"
    ring = [r for r in rows if r["transport"] == "shm-ring" and r["doorbell"] == "semaphore"
            and r["payload_bytes"] == summary["small_payload_bytes"]]
    assert summary["small_ring_p50_us"] == ring[0]["p50_us"]
    assert summary["small_ring_p50_ok"] == (ring[0]["p50_us"] < 30)
