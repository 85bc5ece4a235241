"""`npuserve simulate`: the scheduler core on a virtual clock, continuous vs static vs serial batching.

Prints a table (throughput, TTFT P50/P99, mean TPOT per client
concurrency cap) for each policy, in seconds of wall time, with the same
Scheduler the daemon runs and the `sim` backend's latency model.
"""

from __future__ import annotations

import argparse
import sys

from engine.sim.runner import POLICIES, SIM_PROFILES, serial_table, simulate
from engine.sim.workload import make_workload
from tools.json_lines import emit
from workers.backends.sim_latency import LatencyModel


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("values must be positive")
    return vals


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="npuserve simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--backend-model", default="sim", choices=["sim"], help="latency model (the sim backend's)")
    ap.add_argument("--concurrency", type=_ints, default=[8, 16, 32, 64, 128, 256],
                    help="client concurrency caps, comma-separated")
    ap.add_argument("--requests", type=int, default=120, help="requests per run")
    ap.add_argument("--prompt-mean", type=int, default=1024)
    ap.add_argument("--gen-mean", type=int, default=256)
    ap.add_argument("--chips", type=int, default=1)
    ap.add_argument("--chips-per-replica", type=int, default=1,
                    help="tensor parallelism: chips per replica (divides --chips); each step costs compute / N "
                         "plus two all-reduces per layer (the sim backend's TP latency model)")
    ap.add_argument("--profiles", type=_ints, default=list(SIM_PROFILES), help="compiled decode batches")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"subset of {','.join(POLICIES)}")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--json", action="store_true", help="one JSON row per line")
    return ap


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or args.requests < 1 or args.chips < 1:
        print(f"npuserve simulate: bad arguments (unknown policies {bad})" if bad else
              "npuserve simulate: --requests and --chips must be >= 1", file=sys.stderr)
        return 2
    per = args.chips_per_replica
    if per < 1 or args.chips % per:
        print("npuserve simulate: --chips-per-replica must be >= 1 and divide --chips", file=sys.stderr)
        return 2
    workload = make_workload(args.requests, args.prompt_mean, args.gen_mean, seed=args.seed)
    latency = LatencyModel(tp_degree=per)
    replicas = args.chips // per  # what the scheduler (and the simulator) calls chips
    if not args.json:
        tp = f" as {replicas} replica(s) of {per}" if per > 1 else ""
        print(f"workload: {args.requests} requests, prompt ~{args.prompt_mean}, gen ~{args.gen_mean}, "
              f"{args.chips} chip(s){tp}, profiles {args.profiles}, latency {latency}")
        print(f"{'policy':<20}{'concurrency':>12}{'tok/s':>10}{'TTFT P50 ms':>13}{'TTFT P99 ms':>13}"
              f"{'TPOT ms':>9}{'ITL P99 ms':>12}")
    kw = dict(chips=replicas, latency=latency, profiles=tuple(args.profiles))
    for policy in policies:
        if policy == "serial" and replicas == 1:
            rows = serial_table(args.concurrency, workload, **kw)
        else:
            rows = (simulate(policy, c, workload, **kw) for c in args.concurrency)
        for r in rows:
            c = r.concurrency
            if args.json:
                emit("row", r.row())
            else:
                print(f"{r.policy:<20}{c:>12}{r.throughput_tok_s:>10.1f}{r.ttft_p50_ms:>13.1f}"
                      f"{r.ttft_p99_ms:>13.1f}{r.tpot_mean_ms:>9.1f}{r.itl_p99_ms:>12.1f}")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
