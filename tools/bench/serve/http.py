"""`npuserve bench serve http`: the HTTP front against ZeroMQ on one daemon, side by side, against the front's targets.

It starts one daemon (`stub`, or `llamacpp` on the Gemma package) and an
HTTP front in front of it (`npuserve http --upstream` the daemon), then runs
the same requests, from the same client processes, over ZeroMQ (the client
library, as `npuserve bench`) and over HTTP (streamed `/v1/completions`,
`npuserve bench --openai`), round after round in alternating order. The
daemon's prefix cache is off so the second route does not find the first
one's prompts. Targets: tokens/s through the front >= 0.6x
ZeroMQ on `stub` at 64 streams, >= 0.97x on the Gemma model, and the
front's added TTFT P50 (front minus ZeroMQ) <= 2 ms.
"""

from __future__ import annotations

import argparse
import sys

from tools.bench.options import THREADS, add
from tools.load.paired import Target

# per backend: chips, concurrency, requests per slot, prompt, output, max_inflight, targets
PRESETS = {
    "stub": (2, 64, 8, "normal:64,200", "normal:256,50", 2,
             [Target("tokens_per_s", "min", 0.6), Target("ttft_p50_ms", "diff", 2.0)]),
    "llamacpp": (1, 8, 2, "fixed:64", "fixed:32", 1,
                 [Target("tokens_per_s", "min", 0.97), Target("ttft_p50_ms", "diff", 2.0)]),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    from tools.load.workload import LengthDist

    p = argparse.ArgumentParser(prog="npuserve bench serve http", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=tuple(PRESETS), default="stub")
    add(p, "package", threads=THREADS,
        helps={
            "package": "llamacpp: GGUF package (default: Gemma 3 270M, imported on first use)",
            "threads": "llamacpp: CPU threads of the chip worker",
        })
    p.add_argument("--chips", type=int, help="chip workers (default: 2 stub, 1 llamacpp)")
    p.add_argument("--concurrency", type=int, help="streams outstanding at once (default: 64 stub, 8 llamacpp)")
    p.add_argument("--requests", type=int, help="requests per run (default: a few per stream)")
    p.add_argument("--prompt", help="prompt lengths, as `npuserve bench` (default per backend)")
    p.add_argument("--output", help="output lengths, as `npuserve bench` (default per backend)")
    add(p, "set", rounds=3, clients=2, seed=42)
    p.add_argument("--front-arg", action="append", default=[], metavar="ARG", help="extra argument for the front")
    add(p, "json", "no-progress")
    a = p.parse_args(argv)
    chips, conc, per_slot, prompt, output, inflight, targets = PRESETS[a.backend]
    a.chips = a.chips or chips
    a.concurrency = a.concurrency or conc
    a.requests = a.requests or per_slot * a.concurrency
    a.max_inflight, a.targets = inflight, targets
    if min(a.chips, a.concurrency, a.requests, a.rounds, a.clients) < 1:
        p.error("--chips, --concurrency, --requests, --rounds and --clients must be positive")
    try:
        a.prompt_dist, a.output_dist = LengthDist.parse(a.prompt or prompt), LengthDist.parse(a.output or output)
    except ValueError as e:
        p.error(str(e))
    return a


def daemon_settings(a: argparse.Namespace) -> list[str]:
    out = [f"executor.max_inflight={a.max_inflight}", "kv.prefix_cache=false"]
    if a.backend == "llamacpp":
        from tools.bench.gguf import default_package

        out += [f"model.package=\"{a.package or default_package()}\"",
                f"board.threads_per_chip={max(1, a.threads // a.chips)}", "admission.deadline_default_ms=3600000"]
    return out + a.set


def run(a: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    from tools.load.progress import Progress
    from tools.load import local_front, paired, runner
    from tools.load.openai_load import probe
    from tools.load.workload import LengthDist, WorkloadSpec, build

    progress = Progress(a.rounds * 2 * a.requests, not a.no_progress)
    try:
        with local_front.daemon_and_front("bench-http", backend=a.backend, chips=a.chips, settings=daemon_settings(a),
                                          prefix="nph-", front_extra=a.front_arg) as (d, front, model):
            served = probe(front.url)

            def requests(rnd: int, n: int = a.requests, output=a.output_dist):
                return build(WorkloadSpec(n, a.prompt_dist, output, vocab=min(model["vocab_size"], 256),
                                          max_seq=model["max_seq"], seed=a.seed + rnd))

            def zeromq(reqs, on_record=progress.record):
                return runner.run(d.endpoint, reqs, concurrency=a.concurrency, clients=a.clients, on_record=on_record)

            def http(reqs, on_record=progress.record):
                return runner.run(None, reqs, concurrency=a.concurrency, clients=a.clients, on_record=on_record,
                                  openai=front.url, model=served["id"])

            warm = requests(1000, min(a.concurrency, 8), LengthDist("fixed", 2))
            for route in (zeromq, http):  # untimed: first connections, first requests of each path
                route(warm, None)
            rows = paired.run_rounds({"http": http, "zeromq": zeromq}, requests, a.rounds,
                                     extra={"backend": a.backend, "concurrency": a.concurrency},
                                     on_start=progress.point)
    finally:
        progress.close()
    comparison = paired.compare(rows, "http", "zeromq", a.targets, extra={"backend": a.backend,
                                                                          "concurrency": a.concurrency})
    return rows, comparison


def main(argv: list[str]) -> int:
    from tools.load import paired

    a = parse_args(argv)
    rows, comparison = run(a)
    title = (f"bench-http: {a.backend} backend, {a.chips} chip(s), {a.concurrency} streams, {a.requests} requests "
             f"per run, prompt {a.prompt_dist}, output {a.output_dist}, {a.rounds} rounds; http = the front, "
             f"zeromq = the client library, same daemon")
    return paired.report("bench-http", title, rows, comparison, a.json,
                         {"backend": a.backend, "concurrency": a.concurrency})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
