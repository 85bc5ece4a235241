"""`npuserve bench serve structured`: what JSON-schema constraints cost, against no constraint and llama.cpp's server.

It starts an npuserve daemon on the `llamacpp` backend with its HTTP front
and (unless `--no-peer`) llama.cpp's own server (xllamacpp) on the same GGUF
and threads, and drives them with the same streamed `/v1/completions`
(`npuserve bench --openai` machinery, greedy, 8 streams by default), round
after round in alternating order:

* `npuserve`: unconstrained (`ignore_eos`, as every bench);
* `npuserve+schema`: each request carries one of a mix of JSON schemas in
  llama.cpp's `json_schema` field (which npuserve's front also reads);
* `llama.cpp+schema`: the same requests to llama.cpp's server.

The schemas are long-winded (arrays of objects with a minimum length), so a
constrained request usually runs to `max_tokens`, like the unconstrained one.
Targets: `npuserve+schema` tokens/s >= 0.9x `npuserve`; its TPOT P99 <= 1.0x
`llama.cpp+schema`'s. Also printed: the daemon's schema compile time P50
(`stats` -> constraints) and the workers' mask time per lane and step
(`/metrics`). `--json`: JSON Lines (`kind`: row, summary).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from tools.bench.options import THREADS, add
from tools.load.paired import Target

SCHEMAS = [
    {"type": "object", "properties": {
        "people": {"type": "array", "minItems": 12, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                             "role": {"enum": ["admin", "user", "guest"]}},
            "required": ["name", "age", "role"], "additionalProperties": False}}},
     "required": ["people"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "sections": {"type": "array", "minItems": 10, "items": {
            "type": "object", "properties": {"heading": {"type": "string", "maxLength": 20},
                                             "words": {"type": "integer"}},
            "required": ["heading", "words"], "additionalProperties": False}}},
     "required": ["title", "sections"], "additionalProperties": False},
    {"type": "array", "minItems": 30, "items": {"type": "number"}},
]
TARGETS = {("npuserve+schema", "npuserve"): Target("tokens_per_s", "min", 0.9),
           ("npuserve+schema", "llama.cpp+schema"): Target("tpot_p99_ms", "max", 1.0)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    from tools.load.workload import LengthDist

    p = argparse.ArgumentParser(prog="npuserve bench serve structured", description=__doc__.split("\n\n")[0])
    add(p, "package", threads=THREADS)
    p.add_argument("--concurrency", type=int, default=8, help="streams outstanding at once (default 8)")
    p.add_argument("--per-stream", type=int, default=2, help="requests per stream")
    p.add_argument("--prompt", default="fixed:64", help="prompt lengths, as `npuserve bench`")
    p.add_argument("--output", default="fixed:64", help="output lengths (max_tokens), as `npuserve bench`")
    add(p, rounds=2)
    p.add_argument("--no-peer", action="store_true", help="without llama.cpp's server")
    add(p, "json", "no-progress", seed=42)
    a = p.parse_args(argv)
    try:
        a.prompt_dist, a.output_dist = LengthDist.parse(a.prompt), LengthDist.parse(a.output)
    except ValueError as e:
        p.error(str(e))
    if min(a.concurrency, a.threads, a.per_stream, a.rounds) < 1:
        p.error("--concurrency, --threads, --per-stream and --rounds must be positive")
    return a


def _median(rows: list[dict], label: str, metric: str) -> float | None:
    vals = [r[metric] for r in rows if r["label"] == label and r.get(metric) is not None]
    return statistics.median(vals) if vals else None


def compare(rows: list[dict]) -> list[dict]:
    """Each target's subject/baseline ratio on the medians over rounds."""
    out = []
    for (subject, baseline), t in TARGETS.items():
        s, b = _median(rows, subject, t.metric), _median(rows, baseline, t.metric)
        if s is None or not b:
            continue
        ratio = round(s / b, 3)
        met = ratio >= t.bound if t.kind == "min" else ratio <= t.bound
        out.append({"subject": subject, "baseline": baseline, "metric": t.metric, "subject_median": s,
                    "baseline_median": b, "ratio": ratio, "target": str(t), "met": met})
    return out


def _mask_us_per_step(metrics_text: str) -> float | None:
    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))
    masks = total("npuserve:constraint_masks_total")
    return round(total("npuserve:constraint_mask_seconds_total") * 1e6 / masks, 1) if masks else None


def run(a: argparse.Namespace, pkg, progress) -> tuple[list[dict], dict]:
    from engine.client import Client
    from tools.load import llamacpp_server, local_front, paired, runner
    from tools.load.openai_load import probe
    from tools.load.workload import LengthDist, WorkloadSpec, build

    c = a.concurrency
    n = c * a.per_stream
    ctx = int(max(a.prompt_dist.a, a.prompt_dist.b) + max(a.output_dist.a, a.output_dist.b)) + 16
    metrics_port = local_front.free_port()
    settings = [f"model.package=\"{pkg.path}\"", f"board.threads_per_chip={a.threads}", "executor.max_inflight=1",
                "admission.deadline_default_ms=3600000", f"metrics.port={metrics_port}",
                "metrics.host=\"127.0.0.1\""]
    peer = None
    try:
        with local_front.daemon_and_front("bench-structured", backend="llamacpp", chips=1, settings=settings,
                                          prefix="nps-") as (d, front, _model):
            urls = {"npuserve": front.url, "npuserve+schema": front.url}
            if not a.no_peer:
                peer = llamacpp_server.start(pkg.gguf_path, threads=a.threads, parallel=c, ctx_per_slot=ctx)
                urls["llama.cpp+schema"] = peer.url
            models = {k: probe(u)["id"] for k, u in urls.items()}

            def requests(rnd: int, count: int = n, output=a.output_dist):
                return build(WorkloadSpec(count, a.prompt_dist, output, vocab=256, max_seq=ctx,
                                          seed=a.seed + rnd))

            def route(name: str):
                def go(reqs, on_record=progress.record):
                    if name.endswith("+schema"):
                        for r in reqs:
                            r.extra = {"json_schema": SCHEMAS[r.index % len(SCHEMAS)], "ignore_eos": False}
                    return runner.run(None, reqs, concurrency=c, clients=1, on_record=on_record, openai=urls[name],
                                      model=models[name])
                return go

            routes = {name: route(name) for name in urls}
            warm = requests(1000, min(c, 4), LengthDist("fixed", 2))
            for go in routes.values():  # untimed: first connections, first requests, the schemas' first compile
                go(warm, None)
            rows = paired.run_rounds(routes, requests, a.rounds, extra={"concurrency": c, "threads": a.threads},
                                     on_start=lambda s: progress.point(s))
            with Client(d.endpoint, timeout=30) as cl:
                compile_p50 = cl.stats().get("constraints", {}).get("compile_ms_p50")
            compile_p50 = None if compile_p50 is None else round(compile_p50, 3)
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
                mask_us = _mask_us_per_step(resp.read().decode())
    finally:
        if peer is not None:
            peer.stop()
    return rows, {"schema_compile_ms_p50": compile_p50, "mask_us_per_lane_step": mask_us}


def main(argv: list[str]) -> int:
    from tools.load.progress import Progress
    from tools.bench.gguf import load_gguf
    from tools.load.report import publish, table

    a = parse_args(argv)
    pkg = load_gguf(a.package, "npuserve bench serve structured")
    routes = 2 if a.no_peer else 3
    progress = Progress(routes * a.rounds * a.concurrency * a.per_stream, not a.no_progress)
    try:
        rows, extra = run(a, pkg, progress)
    finally:
        progress.close()
    comparison = compare(rows)
    summary = {"package": pkg.name, "threads": a.threads, "concurrency": a.concurrency, **extra,
               "comparison": comparison, "targets_met": all(c["met"] for c in comparison) if comparison else None}
    def text() -> str:
        out = [f"bench-structured: {pkg.name}, {a.threads} thread(s) each, {a.concurrency} streams, prompt "
               f"{a.prompt_dist}, output {a.output_dist}, greedy, {a.rounds} rounds; a mix of {len(SCHEMAS)} "
               f"JSON schemas in `json_schema`", table(rows)]
        for c in comparison:
            out.append(f"  {c['metric']:<13} {c['subject']} {c['subject_median']:,.3f} vs {c['baseline']} "
                       f"{c['baseline_median']:,.3f}: ratio {c['ratio']} [target {c['target']}: "
                       f"{'met' if c['met'] else 'MISSED'}]")
        out.append(f"  schema compile time P50 (daemon, at admission): {extra['schema_compile_ms_p50']} ms; "
                   f"mask time per lane and step (workers): {extra['mask_us_per_lane_step']} us")
        return "\n".join(out)

    return publish("bench-structured", a.json, [*(("row", r) for r in rows), ("summary", summary)], text, rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
