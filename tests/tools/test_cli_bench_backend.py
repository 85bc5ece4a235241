"""`npuserve bench-backend` end to end: both modes, every phase, the JSON row format, for each backend kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from repo_root import ROOT


@pytest.mark.parametrize("backend", ["stub", "ref", "ctypes"])
def test_bench_backend_json_rows_cover_both_modes(backend):
    out = subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench-backend", "--backend", backend, "--batches", "1,4",
         "--prompt-len", "8", "--decode-steps", "2", "--seconds", "0.02", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rows = [json.loads(line) for line in lines]  # the --json convention: every stdout line is one object
    assert {(r["mode"], r["phase"], r["batch"]) for r in rows} == {
        (m, p, b) for m in ("in-process", "worker") for p in ("prefill", "decode") for b in (1, 4)
    }
    assert all(set(r) == {"kind", "mode", "phase", "batch", "tokens_per_s"} and r["kind"] == "row"
               and r["tokens_per_s"] > 0 for r in rows)


def test_bench_backend_tp_rows_and_allreduce():
    out = subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench-backend", "--tp", "1,2", "--batches", "1,4", "--prompt-len", "8",
         "--decode-steps", "2", "--tp-rounds", "1", "--tp-repeats", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    tp = [r for r in rows if r["kind"] == "tp_row"]
    assert {(r["batch"], r["tp"]) for r in tp} == {(b, w) for b in (1, 4) for w in (1, 2)}
    assert all(r["tokens_per_s"] > 0 for r in tp) and all(r["vs_tp1"] == 1.0 for r in tp if r["tp"] == 1)
    ar = [r for r in rows if r["kind"] == "allreduce"]
    assert {r["bytes"] for r in ar} == {1 * 64 * 4, 4 * 64 * 4} and all(r["allreduce_us"] > 0 for r in ar)
    assert rows[-1]["kind"] == "tp_summary"


def test_bench_backend_loop_steps_rows_compare_the_device_loop_with_the_host_loop():
    out = subprocess.run(
        [sys.executable, "-m", "tools.cli", "bench-backend", "--backend", "ctypes", "--loop-steps", "4",
         "--batches", "1,4", "--prompt-len", "8", "--decode-steps", "8", "--seconds", "0.02", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    loops = [r for r in rows if r["kind"] == "loop_row"]
    assert {(r["mode"], r["loop"], r["batch"]) for r in loops} == {
        (m, w, b) for m in ("in-process", "worker") for w in ("per-step", "host-loop", "device-loop") for b in (1, 4)}
    assert all(r["tokens_per_s"] > 0 and r["jobs_per_round"] == (8 if r["loop"] == "per-step" else 2)
               for r in loops)
    summaries = [r for r in rows if r["kind"] == "loop_summary"]
    assert len(summaries) == 4 and all(s["device_vs_host_loop"] > 0 for s in summaries)
    refused = subprocess.run([sys.executable, "-m", "tools.cli", "bench-backend", "--backend", "ref", "--loop-steps",
                              "4"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--loop-steps needs --backend ctypes" in refused.stderr
