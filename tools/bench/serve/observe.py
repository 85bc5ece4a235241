"""`npuserve bench serve observe`: what metrics and tracing cost the daemon, side by side in one run.

Runs `bench-serve` (stub backend by default) alternately in three set-ups,
`--rounds` times each, so machine noise hits all of them alike:

* `plain`: no metrics port, no trace (the figures are still recorded: `stats` reports them);
* `metrics`: /metrics served and scraped every `--scrape-interval` s by this process;
* `trace`: `--trace FILE` on.

and reports the median generated tokens/s of each and its ratio to `plain`,
plus the trace file's size. It also measures in-process what recording costs
per generated token (MetricsRecorder.on_actions on EmitTokens) and per trace
event, against the per-token budget of the `plain` run.
Targets: metrics served and scraped >= 97 % of plain; trace on >= 90 % of plain.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import urllib.request

from tools.bench.options import add
from tools.load.paired import alternate, medians
from tools.load.report import publish
from tools.load.ports import free_port

TARGETS = {"metrics": 0.97, "trace": 0.90}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve bench serve observe", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("stub", "sim", "ref"), default="stub")
    add(p, rounds=2)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--scrape-interval", type=float, default=1.0)
    add(p, "json")
    return p.parse_args(argv)


def _serve_run(a: argparse.Namespace, variant: str, tmp: str) -> dict:
    from tools.bench.serve import point as bench_serve

    argv = ["--backend", a.backend, "--requests", str(a.requests), "--concurrency", str(a.concurrency)]
    stop = threading.Event()
    scrapes = [0]
    trace = os.path.join(tmp, "t.json")
    if variant == "metrics":
        port = free_port()
        argv += ["--set", f"metrics.port={port}"]

        def scrape() -> None:
            while not stop.wait(a.scrape_interval):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                        r.read()
                    scrapes[0] += 1
                except OSError:
                    pass  # not up yet / already gone

        threading.Thread(target=scrape, daemon=True).start()
    elif variant == "trace":
        argv += [f"--daemon-arg=--trace={trace}"]
    try:
        res = bench_serve.run(bench_serve.parse_args(argv))
    finally:
        stop.set()
    out = {"variant": variant, "tokens_per_s": res["tokens_per_s"], "errors": res["errors"],
           "tpot_p50_ms": res["tpot_p50_ms"], "scrapes": scrapes[0] if variant == "metrics" else None,
           "trace_bytes": None}
    if variant == "trace":
        out["trace_bytes"] = os.path.getsize(trace)
        os.unlink(trace)
    return out


def _micro() -> dict:
    """In-process cost of recording: per EmitTokens (metrics) and per trace turn event."""
    from engine.core.actions import EmitTokens
    from engine.daemon.observability.metrics import MetricsRecorder
    from engine.daemon.observability.trace import TraceWriter

    m = MetricsRecorder("bench")
    acts = [EmitTokens(i, [1]) for i in range(64)]
    now, n = 1.0, 3000
    m.on_actions(acts, now)
    t = time.perf_counter()
    for _ in range(n):
        now += 0.001
        m.on_actions(acts, now)
    per_token = (time.perf_counter() - t) / (n * len(acts))
    with tempfile.TemporaryDirectory() as d:
        tw = TraceWriter(os.path.join(d, "t.json"), board="b", max_events=10**9)
        t = time.perf_counter()
        for i in range(50_000):
            tw.turn(i * 1e-3, i * 1e-3 + 1e-4, 2, 3)
        per_event = (time.perf_counter() - t) / 50_000
        tw.close()
    return {"metrics_us_per_token": round(per_token * 1e6, 3), "trace_us_per_event": round(per_event * 1e6, 3)}


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    variants = ("plain", "metrics", "trace")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="npsobs-") as tmp:

        def run(v: str, r: int, _group) -> None:
            if not a.json:
                print(f"bench-observe: round {r + 1}/{a.rounds}, {v} ...", file=sys.stderr, flush=True)
            runs[v].append(_serve_run(a, v, tmp))

        alternate(variants, a.rounds, run, flip=lambda rnd, group: False)  # the same order every round
    micro = _micro()
    labelled = [{"label": v, **x} for v in variants for x in runs[v]]
    base = medians(labelled, "plain", ("tokens_per_s",))["tokens_per_s"]
    rows = []
    for v in variants:
        tps = medians(labelled, v, ("tokens_per_s",))["tokens_per_s"]
        ratio = tps / base if base else None
        target = TARGETS.get(v)
        rows.append({"variant": v, "tokens_per_s": round(tps, 1), "ratio_to_plain": round(ratio, 4),
                     "target_ratio": target, "ok": None if target is None else ratio >= target,
                     "runs": [x["tokens_per_s"] for x in runs[v]],
                     "errors": sum(x["errors"] for x in runs[v]),
                     "scrapes": sum(x["scrapes"] or 0 for x in runs[v]) if v == "metrics" else None,
                     "trace_bytes": max(x["trace_bytes"] for x in runs[v]) if v == "trace" else None})
    budget_us = 1e6 / base if base else None
    micro["plain_us_per_token"] = round(budget_us, 3) if budget_us else None
    micro["metrics_share_of_token"] = round(micro["metrics_us_per_token"] / budget_us, 4) if budget_us else None

    def text() -> str:
        out = [f"bench-observe: {a.backend} backend, {a.requests} requests at concurrency {a.concurrency}, "
               f"{a.rounds} rounds (median)", f"  {'variant':<8} {'tokens/s':>10} {'vs plain':>9} {'target':>7}  runs"]
        for row in rows:
            tgt = "" if row["target_ratio"] is None else f">= {row['target_ratio']:.2f}"
            verdict = "" if row["ok"] is None else ("ok" if row["ok"] else "MISSED")
            extra = ""
            if row["scrapes"] is not None:
                extra = f"  ({row['scrapes']} scrapes)"
            if row["trace_bytes"] is not None:
                extra = f"  (trace file {row['trace_bytes'] / 1e6:.1f} MB)"
            out.append(f"  {row['variant']:<8} {row['tokens_per_s']:>10.1f} {row['ratio_to_plain']:>9.3f} {tgt:>7} "
                       f"{verdict:<6} {row['runs']}{extra}")
        out.append(f"  in-process: metrics {micro['metrics_us_per_token']} µs per generated token "
                   f"({100 * (micro['metrics_share_of_token'] or 0):.1f} % of the plain run's "
                   f"{micro['plain_us_per_token']} µs per token); trace {micro['trace_us_per_event']} µs per event")
        return "\n".join(out)

    failed = publish("bench-observe", a.json,
                     [*(("row", row) for row in rows), ("summary", {"variant": "in-process", **micro})], text, rows)
    return 1 if failed or any(r["ok"] is False for r in rows) else 0
