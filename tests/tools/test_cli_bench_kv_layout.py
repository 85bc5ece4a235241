"""`npuserve bench-kv-layout` end to end on the tiny GGUF model (the mechanics; Gemma's figure is in docs/models.md)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from repo_root import ROOT
from workers.default_package import ensure_default_gguf_package


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", "bench-kv-layout", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_bench_kv_layout_times_every_context_alternating_and_summarises_the_medians():
    r = _run("--package", ensure_default_gguf_package(), "--streams", "3", "--prompt-tokens", "16", "--reps", "2",
             "--instances", "2", "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    rows, summary = lines[:-1], lines[-1]
    first = [("shared", 1), ("per-sequence", 1), ("shared", 2), ("per-sequence", 2)]
    assert [(x["rep"], x["layout"], x["instance"]) for x in rows] == \
        [(1, la, k) for la, k in first] + [(2, la, k) for la, k in reversed(first)]
    assert all(x["kind"] == "row" and x["streams"] == 3 and x["prompt_tokens"] == 16 and x["ms"] > 0
               and x["tokens_per_s"] > 0 for x in rows)
    med = {k: statistics.median(x["ms"] for x in rows if x["layout"] == k) for k in ("shared", "per-sequence")}
    ctx = {f"{la} {k}": statistics.median(x["ms"] for x in rows if (x["layout"], x["instance"]) == (la, k))
           for la, k in first}
    assert summary["kind"] == "summary" and summary["median_ms"] == med and summary["target"] is None
    assert summary["instance_median_ms"] == ctx
    assert summary["per_sequence_over_shared"] == round(med["per-sequence"] / med["shared"], 3)
    spread = max(max(ctx[f"{la} 1"], ctx[f"{la} 2"]) / min(ctx[f"{la} 1"], ctx[f"{la} 2"])
                 for la in ("shared", "per-sequence"))
    assert summary["instance_spread"] == round(spread, 3) >= 1.0


def test_bench_kv_layout_refuses_a_package_that_is_not_gguf_and_bad_counts():
    from workers.default_package import ensure_default_package

    r = _run("--package", ensure_default_package(), "--reps", "1")
    assert r.returncode == 2 and "not a GGUF package" in r.stderr and "import-gguf" in r.stderr
    for bad in (["--streams", "0"], ["--instances", "0"]):
        r = _run(*bad)
        assert r.returncode == 2 and "must be positive" in r.stderr
