"""`npuserve bench serve balancer`: what the balancer costs and what its routing buys, against the same daemons.

One run starts `--daemons` stub board daemons (one chip each, tcp://) and
balancers in front of them, then reports side by side:

* added latency: sequential 1-token requests, alternating direct to daemon 0
  and through a balancer whose only backend is daemon 0 (P50/P99 of each and
  the difference; target <= 0.5 ms at P50);
* throughput: streamed stub tokens/s at `--concurrency`, direct (clients split
  evenly over the daemons) against through one balancer over all of them,
  `--rounds` runs per side in ABBA order (target >= 0.9x);
* routing: a shared-prefix workload per policy (round-robin, least-load,
  prefix) on fresh prefixes, with the daemon-side prefix hit rate and TTFT.

This is a separate tool rather than a `bench-serve` flag: it needs several
daemons and balancers in one run, and bench-serve drives one daemon.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from tools.bench.options import add
from tools.load import local_daemon, paired, runner
from tools.load.fleet import Fleet
from tools.load.local_balancer import LocalBalancer
from tools.load.report import pct, publish, summarize
from tools.load.workload import Request

POLICIES = ("round-robin", "least-load", "prefix")
TARGET_ADDED_P50_MS = 0.5
TARGET_RATIO = 0.9


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve bench serve balancer", description=__doc__.split("\n\n")[0])
    p.add_argument("--daemons", type=int, default=2)
    p.add_argument("--latency-requests", type=int, default=300, help="sequential requests per side")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=256, help="throughput requests per side")
    p.add_argument("--gen-tokens", type=int, default=256)
    add(p, clients=2, rounds=2,
        helps={
            "clients": "client processes for the throughput runs",
            "rounds": "throughput runs per side, in ABBA order",
        })
    p.add_argument("--prefix-requests", type=int, default=60)
    add(p, "json")
    return p.parse_args(argv)


# ---------------------------------------------------------------- load


def _load(endpoints: list[str], concurrency: int, reqs: list[Request], clients: int) -> dict:
    """One closed-loop run (`tools.load.runner`; each client process takes `endpoints` in turn): its figures."""
    row = summarize(runner.run(endpoints, reqs, concurrency=concurrency, clients=clients))
    return {k: row[k] for k in ("requests", "errors", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")}


# ---------------------------------------------------------------- processes


def _daemon(fleet: Fleet, i: int) -> str:
    return fleet.daemon("stub", f"bb{i}", ["executor.max_inflight=2"])


def _balancer(fleet: Fleet, backends: list[str], policy: str, what: str) -> LocalBalancer:
    b = fleet.balancer(["--backends", ",".join(backends), "--policy", policy], f"{what}-{policy}")
    local_daemon.wait_healthy(b.endpoint, timeout=120, backends_up=len(backends))
    return b


def _prefix_hits(endpoints: list[str]) -> int:
    from engine.client import Client

    n = 0
    for e in endpoints:
        with Client(e, timeout=10) as c:
            n += c.stats()["scheduler"]["counters"].get("prefix_hit_tokens", 0)
    return n


# ---------------------------------------------------------------- the three measurements


def _latency(direct: str, via: str, n: int) -> dict:
    from engine.client import Client

    lat: dict[str, list[float]] = {"direct": [], "via": []}
    with Client(direct, timeout=30) as d, Client(via, timeout=30) as b:
        clients = {"direct": d, "via": b}
        for c in (d, b):
            for _ in range(20):
                c.generate([1, 2, 3, 4, 5, 6, 7, 8], max_tokens=1)  # warm-up

        def one(name: str, i: int, _group) -> None:  # a round of one request per side
            t0 = time.perf_counter()
            clients[name].generate([1, 2, 3, 4, 5, 6, 7, 8], max_tokens=1, seed=i)
            lat[name].append((time.perf_counter() - t0) * 1000)

        paired.alternate(("direct", "via"), n, one)
    out = {f"{k}_p{q}_ms": pct(v, q / 100) for k, v in lat.items() for q in (50, 99)}
    out["added_p50_ms"] = round(out["via_p50_ms"] - out["direct_p50_ms"], 3)
    out["added_p99_ms"] = round(out["via_p99_ms"] - out["direct_p99_ms"], 3)
    return out


def _throughput(a: argparse.Namespace, daemons: list[str], via: str) -> dict:
    rng = random.Random(1)
    reqs = [Request(i, [rng.randrange(1, 250) for _ in range(32)], a.gen_tokens, seed=i) for i in range(a.requests)]
    sides = {"direct": daemons, "via": [via]}
    runs: dict[str, list[dict]] = {"direct": [], "via": []}
    paired.alternate(("direct", "via"), a.rounds,
                     lambda side, _r, _g: runs[side].append(_load(sides[side], a.concurrency, reqs, max(1, a.clients))))
    out = {}
    for side, rs in runs.items():
        out[side] = {"tokens_per_s": round(sum(x["tokens_per_s"] for x in rs) / len(rs), 1),
                     "errors": sum(x["errors"] for x in rs), "runs_tokens_per_s": [x["tokens_per_s"] for x in rs],
                     "ttft_p50_ms": pct([x["ttft_p50_ms"] for x in rs], 0.5)}
    out["ratio"] = round(out["via"]["tokens_per_s"] / max(out["direct"]["tokens_per_s"], 1e-9), 3)
    return out


def _routing(a: argparse.Namespace, fleet: Fleet, daemons: list[str]) -> dict:
    out = {}
    for tag, policy in enumerate(POLICIES):
        bal = _balancer(fleet, daemons, policy, "routing")
        ep = bal.endpoint
        rngs = [random.Random(1000 * tag + g) for g in range(5)]
        prefixes = [[r.randrange(1, 250) for _ in range(256)] for r in rngs]
        reqs = [Request(i, prefixes[i % 5] + [i % 250 + 1, 7], 8, seed=i) for i in range(a.prefix_requests)]
        before = _prefix_hits(daemons)
        s = _load([ep], 8, reqs, 1)
        hits = _prefix_hits(daemons) - before
        s["prefix_hit_rate"] = round(hits / sum(len(r.prompt) for r in reqs), 4)
        out[policy] = s
        bal.stop()
    return out


def run(a: argparse.Namespace) -> dict:
    fleet = Fleet("npsbb-")
    try:
        daemons = [_daemon(fleet, i) for i in range(a.daemons)]
        for e in daemons:
            local_daemon.wait_healthy(e, timeout=120)
        one = _balancer(fleet, daemons[:1], "least-load", "one").endpoint
        all_ = _balancer(fleet, daemons, "least-load", "all").endpoint
        if not a.json:
            print("bench-balancer: measuring added latency ...", file=sys.stderr, flush=True)
        lat = _latency(daemons[0], one, a.latency_requests)
        if not a.json:
            print("bench-balancer: measuring throughput ...", file=sys.stderr, flush=True)
        thr = _throughput(a, daemons, all_)
        if not a.json:
            print("bench-balancer: shared-prefix workload per policy ...", file=sys.stderr, flush=True)
        routing = _routing(a, fleet, daemons)
    finally:
        fleet.close()
    return {"daemons": a.daemons, "backend": "stub", "latency": lat, "throughput": thr, "routing": routing,
            "targets": {"added_p50_ms": TARGET_ADDED_P50_MS, "ratio": TARGET_RATIO},
            "added_p50_vs_target": round(lat["added_p50_ms"] / TARGET_ADDED_P50_MS, 2),
            "ratio_vs_target": round(thr["ratio"] / TARGET_RATIO, 3)}


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    res = run(a)
    lat, thr = res["latency"], res["throughput"]

    def text() -> str:
        out = [f"bench-balancer: {a.daemons} stub daemons (1 chip each), tcp:// loopback",
               f"{'latency (1-token request)':<28} {'direct':>10} {'via balancer':>13} {'added':>8}   target"]
        for q in (50, 99):
            added = lat[f"added_p{q}_ms"]
            tgt = f"<= {TARGET_ADDED_P50_MS} ms ({'met' if added <= TARGET_ADDED_P50_MS else 'MISSED'})" if q == 50 \
                else ""
            out.append(f"  P{q} ms{'':<21} {lat[f'direct_p{q}_ms']:>10} {lat[f'via_p{q}_ms']:>13} {added:>8}   {tgt}")
        d, v = thr["direct"], thr["via"]
        verdict = "met" if thr["ratio"] >= TARGET_RATIO else "MISSED"
        out += [f"{'throughput (stub tokens/s)':<28} {d['tokens_per_s']:>10} {v['tokens_per_s']:>13} "
                f"{thr['ratio']:>7}x   >= {TARGET_RATIO}x ({verdict})",
                f"  concurrency {a.concurrency}, {a.requests} requests x {a.gen_tokens} tokens per run, {a.rounds} "
                f"runs per side (ABBA), mean of runs; runs: direct {d['runs_tokens_per_s']}, via "
                f"{v['runs_tokens_per_s']}; errors {d['errors']} / {v['errors']}",
                f"{'shared-prefix workload':<28} {'hit rate':>10} {'TTFT P50':>10} {'TTFT P99':>10}"]
        for pol, s in res["routing"].items():
            out.append(f"  {pol:<26} {s['prefix_hit_rate']:>10} {s['ttft_p50_ms']:>10} {s['ttft_p99_ms']:>10}")
        return "\n".join(out)

    publish("bench-balancer", a.json, [("row", {"section": s, **res[s]}) for s in ("latency", "throughput", "routing")],
            text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
