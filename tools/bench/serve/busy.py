"""`npuserve bench serve busy`: keeping every chip busy, each executor mode against the synchronous run, in one run.

Runs `bench-serve` on each backend (`ref` and `sim` by default) in four
executor modes, alternating their order every round so machine noise hits
them alike:

* `sync`: one job in flight per chip, nothing queued (the baseline);
* `queued`: one job in flight plus its lanes' next step queued behind it
  (`executor.queue_next_step`);
* `pingpong`: two jobs in flight per chip (`executor.max_inflight = 2`);
* `pingpong+queued`: both;
* `steps4`, `steps8` (with `--modes`): multi-step decode, `executor.decode_steps` = 4 or 8, one in flight.

For each: delivered tokens/s, TPOT P50/P99 at the client, the chips' device
busy fraction over the run (stats: device seconds / window), and on `sim`
the in-process simulator's prediction for the same requests. Targets, on the
medians over rounds (docs/benchmarks.md): on `ref`, `queued` TPOT P50 within
3 % and P99 within 5 % of `sync` (queueing the next step must not cost latency);
on `sim`, `pingpong` tokens/s >= 1.10x `sync` with TPOT P99 within 5 % (what
two jobs in flight must earn to be worth turning on), and every mode
delivering >= 99 % of its prediction. Outputs of every mode equal the
synchronous run's: that is checked by the tests
(tests/engine/core/test_scheduler_queued_step.py,
tests/engine/daemon/test_daemon_ref.py), not here.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from tools.bench.options import add
from tools.json_lines import emit
from tools.load import paired
from tools.load.report import publish

MODES = {
    "sync": {"max_inflight": 1, "queue": False},
    "queued": {"max_inflight": 1, "queue": True},
    "pingpong": {"max_inflight": 2, "queue": False},
    "pingpong+queued": {"max_inflight": 2, "queue": True},
    "steps4": {"max_inflight": 1, "queue": False, "steps": 4},  # multi-step decode (executor.decode_steps)
    "steps8": {"max_inflight": 1, "queue": False, "steps": 8},
}
DEFAULT_MODES = ("sync", "queued", "pingpong", "pingpong+queued")
# (backend, subject, baseline, metric, kind, bound): kind "max" = ratio <= bound, "min" = ratio >= bound
TARGETS = (
    ("ref", "queued", "sync", "tpot_p50_ms", "max", 1.03),
    ("ref", "queued", "sync", "tpot_p99_ms", "max", 1.05),
    ("sim", "pingpong", "sync", "tokens_per_s", "min", 1.10),
    ("sim", "pingpong", "sync", "tpot_p99_ms", "max", 1.05),
)
DELIVERED_TARGET = 0.99  # sim: delivered / predicted tokens/s, each mode


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve bench serve busy", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="ref,sim", help="comma-separated: ref, sim, stub")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated, of: " + ", ".join(MODES))
    add(p, rounds=2)
    p.add_argument("--concurrency", type=int, default=32, help="32: two full B16 batches for ping/pong")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--chips", type=int, default=1)
    p.add_argument("--gen-mean", type=int, help="mean generated tokens (default: bench-serve's)")
    add(p, "set")
    p.add_argument("--sim-host-ms", type=float, default=4.0,
                   help="sim: the host side of each step (h2d, launch, d2h) that an early hand-over hides "
                        "(LatencyModel.host_ms; default 4)")
    add(p, "json")
    return p.parse_args(argv)


def _run(a: argparse.Namespace, backend: str, mode: str) -> dict:
    from tools.bench.serve import point as bench_serve

    m = MODES[mode]
    argv = ["--backend", backend, "--concurrency", str(a.concurrency), "--requests", str(a.requests),
            "--chips", str(a.chips), "--max-inflight", str(m["max_inflight"]),
            "--set", f"executor.queue_next_step={'true' if m['queue'] else 'false'}",
            "--set", f"executor.decode_steps={m.get('steps', 1)}"]
    if a.gen_mean:
        argv += ["--gen-mean", str(a.gen_mean)]
    for kv in a.set:
        argv += ["--set", kv]
    if backend == "sim":
        argv += ["--backend-option", f"host_ms={a.sim_host_ms}"]
    res = bench_serve.run(bench_serve.parse_args(argv))
    ran = res.get("daemon_run") or {}
    busy = ran.get("device_busy") or []
    pred = res.get("predicted_tokens_per_s")
    return {"backend": backend, "mode": mode, "tokens_per_s": res["tokens_per_s"],
            "tpot_p50_ms": res["tpot_p50_ms"], "tpot_p99_ms": res["tpot_p99_ms"],
            "ttft_p50_ms": res["ttft_p50_ms"], "device_busy": round(statistics.mean(busy), 4) if busy else None,
            "predicted_tokens_per_s": pred,
            "delivered_of_predicted": round(res["tokens_per_s"] / pred, 4) if pred else None,
            "decode_jobs": ran.get("decode_jobs"), "mean_decode_lanes": ran.get("mean_decode_lanes"),
            "errors": res["errors"]}


def _median(rows: list[dict], backend: str, mode: str, metric: str) -> float | None:
    vals = [r[metric] for r in rows if r["backend"] == backend and r["mode"] == mode and r.get(metric) is not None]
    return statistics.median(vals) if vals else None


def comparisons(rows: list[dict], backends: list[str], modes: list[str]) -> list[dict]:
    out = []
    for backend, subject, baseline, metric, kind, bound in TARGETS:
        if backend not in backends or subject not in modes or baseline not in modes:
            continue
        s, b = _median(rows, backend, subject, metric), _median(rows, backend, baseline, metric)
        if s is None or not b:
            continue
        ratio = round(s / b, 4)
        met = ratio <= bound if kind == "max" else ratio >= bound
        out.append({"backend": backend, "subject": subject, "baseline": baseline, "metric": metric,
                    "subject_median": s, "baseline_median": b, "ratio": ratio,
                    "target": f"{'<=' if kind == 'max' else '>='} {bound:g}x", "met": met,
                    "margin": round(bound - ratio if kind == "max" else ratio - bound, 4)})
    for backend in backends:
        for mode in modes:
            d = _median(rows, backend, mode, "delivered_of_predicted")
            if d is not None:
                out.append({"backend": backend, "subject": mode, "baseline": "predicted",
                            "metric": "delivered_of_predicted", "subject_median": d, "baseline_median": 1.0,
                            "ratio": d, "target": f">= {DELIVERED_TARGET:g}", "met": d >= DELIVERED_TARGET,
                            "margin": round(d - DELIVERED_TARGET, 4)})
        base = _median(rows, backend, "sync", "tokens_per_s") if "sync" in modes else None
        for mode in modes:
            s = _median(rows, backend, mode, "tokens_per_s")
            if mode != "sync" and base and s is not None and not any(
                    c["backend"] == backend and c["subject"] == mode and c["metric"] == "tokens_per_s" for c in out):
                out.append({"backend": backend, "subject": mode, "baseline": "sync", "metric": "tokens_per_s",
                            "subject_median": s, "baseline_median": base, "ratio": round(s / base, 4)})
    return out


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    backends = [b for b in a.backends.split(",") if b]
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            print(f"bench-busy: unknown mode {m!r} (one of {', '.join(MODES)})", file=sys.stderr)
            return 2

    def run(mode: str, rnd: int, backend: str) -> dict:
        if not a.json:
            print(f"bench-busy: round {rnd + 1}/{a.rounds}, {backend} {mode} ...", file=sys.stderr, flush=True)
        row = {"round": rnd + 1, **_run(a, backend, mode)}
        if a.json:
            emit("row", row)
        return row

    rows = paired.alternate(modes, a.rounds, run, groups=backends)
    comp = comparisons(rows, backends, modes)
    met = [c["met"] for c in comp if "met" in c]

    def text() -> str:
        out = [f"bench-busy: {a.requests} requests at concurrency {a.concurrency}, {a.chips} chip(s), "
               f"{a.rounds} rounds (medians)",
               f"  {'backend':<7} {'mode':<16} {'tok/s':>8} {'TPOT p50':>9} {'TPOT p99':>9} {'busy':>6} "
               f"{'predicted':>9} {'deliv.':>7} {'lanes':>6}"]
        for backend in backends:
            for mode in modes:
                def med(k: str, fmt: str) -> str:
                    v = _median(rows, backend, mode, k)
                    return "-" if v is None else format(v, fmt)
                out.append(f"  {backend:<7} {mode:<16} {med('tokens_per_s', '.1f'):>8} {med('tpot_p50_ms', '.2f'):>9} "
                           f"{med('tpot_p99_ms', '.2f'):>9} {med('device_busy', '.3f'):>6} "
                           f"{med('predicted_tokens_per_s', '.1f'):>9} {med('delivered_of_predicted', '.3f'):>7} "
                           f"{med('mean_decode_lanes', '.2f'):>6}")
        for c in comp:
            verdict = "" if "met" not in c else f"  [target {c['target']}: {'met' if c['met'] else 'MISSED'}, " \
                                                 f"margin {c['margin']:+.4f}]"
            out.append(f"  {c['backend']} {c['subject']} vs {c['baseline']}: {c['metric']} {c['subject_median']:.3f} "
                       f"vs {c['baseline_median']:.3f} = {c['ratio']:.3f}x{verdict}")
        return "\n".join(out)

    summary = {"backends": backends, "modes": modes, "rounds": a.rounds, "concurrency": a.concurrency,
               "requests": a.requests, "chips": a.chips, "targets_met": all(met) if met else None}
    return publish("bench-busy", a.json, [*(("comparison", c) for c in comp), ("summary", summary)], text, rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
