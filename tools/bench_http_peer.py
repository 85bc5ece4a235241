"""`npuserve bench-http-peer`: npuserve against llama.cpp's own server, both over HTTP, on the same GGUF.

It starts both servers itself: llama.cpp's server (xllamacpp, llama.cpp's
HTTP server and slots; `--parallel` = the concurrency) and an npuserve daemon
on the `llamacpp` backend with its HTTP front, each with the same CPU
threads, and drives both with the same requests (`npuserve bench --openai`:
streamed `/v1/completions`, token-id prompts, greedy, `ignore_eos`), round
after round in alternating order, fresh servers for every concurrency. It
prints the runs, the npuserve / llama.cpp ratios of the medians, and the
distance from bench-peer's targets (tokens/s >= 1.0x, TTFT P99 <= 1.0x),
which now include both HTTP layers.
"""

from __future__ import annotations

import argparse
import sys

from tools.load.paired import Target

TARGETS = [Target("tokens_per_s", "min", 1.0), Target("ttft_p99_ms", "max", 1.0)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    from workers.backends.llamacpp import default_threads
    from tools.load.workload import LengthDist

    p = argparse.ArgumentParser(prog="npuserve bench-http-peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--package", help="GGUF package (default: Gemma 3 270M, imported on first use)")
    p.add_argument("--threads", type=int, default=default_threads(), help="CPU threads of each engine")
    p.add_argument("--concurrency", default="1,8", help="streams outstanding at once, a list (default 1,8)")
    p.add_argument("--per-stream", type=int, default=2, help="requests per stream")
    p.add_argument("--prompt", default="fixed:64", help="prompt lengths, as `npuserve bench`")
    p.add_argument("--output", default="fixed:32", help="output lengths, as `npuserve bench`")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs both engines, order flipping")
    p.add_argument("--clients", type=int, default=1, help="client processes per run")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="npuserve daemon config override")
    p.add_argument("--scenario", metavar="NAME",
                   help="a head-to-head scenario instead of uniform load: long-prompt, tenant-flood, burst, hangups "
                        "(tools/load/scenarios.py; docs/benchmarks.md)")
    p.add_argument("--scenario-option", action="append", default=[], metavar="KEY=VALUE", help="a scenario size")
    p.add_argument("--slots", type=int, default=8,
                   help="with --scenario: llama.cpp's slots = npuserve's admission.max_sequences (default 8)")
    p.add_argument("--plot", metavar="FILE.png", help="with --scenario: its plot (long-prompt, tenant-flood)")
    p.add_argument("--records", metavar="FILE.jsonl", help="with --scenario: every request's record")
    p.add_argument("--json", action="store_true", help="JSON Lines: one row per run, then the summary")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    try:
        a.concurrencies = [int(x) for x in a.concurrency.split(",") if x.strip()]
        a.prompt_dist, a.output_dist = LengthDist.parse(a.prompt), LengthDist.parse(a.output)
    except ValueError as e:
        p.error(str(e))
    if not a.concurrencies or min(a.concurrencies + [a.threads, a.per_stream, a.rounds, a.clients, a.slots]) < 1:
        p.error("--concurrency, --threads, --per-stream, --rounds, --clients and --slots must be positive")
    if a.scenario:
        from tools.bench_scenario import options_of
        from tools.load import scenarios

        try:
            options_of(a.scenario_option, scenarios.get(a.scenario), False)
        except ValueError as e:
            p.error(str(e))
        if a.plot:
            from tools.load.plot import require_matplotlib

            require_matplotlib()
    elif a.scenario_option or a.plot or a.records:
        p.error("--scenario-option, --plot and --records go with --scenario")
    return a


def run_concurrency(a: argparse.Namespace, pkg, c: int, progress) -> tuple[list[dict], list[dict]]:
    from tools.load import llamacpp_server, local_front, paired, runner
    from tools.load.openai_load import probe
    from tools.load.workload import LengthDist, WorkloadSpec, build

    n = c * a.per_stream
    ctx = int(max(a.prompt_dist.a, a.prompt_dist.b) + max(a.output_dist.a, a.output_dist.b)) + 16
    settings = [f"model.package=\"{pkg.path}\"", f"board.threads_per_chip={a.threads}", "executor.max_inflight=1",
                "admission.deadline_default_ms=3600000", *a.set]
    peer = None
    try:
        with local_front.daemon_and_front("bench-http-peer", backend="llamacpp", chips=1, settings=settings,
                                          prefix="npp-") as (_d, front, _model):
            peer = llamacpp_server.start(pkg.gguf_path, threads=a.threads, parallel=c, ctx_per_slot=ctx)
            urls = {"npuserve": front.url, "llama.cpp": peer.url}
            models = {k: probe(u)["id"] for k, u in urls.items()}

            def requests(rnd: int, count: int = n, output=a.output_dist):
                return build(WorkloadSpec(count, a.prompt_dist, output, vocab=256, max_seq=ctx,
                                          seed=a.seed + 100 * c + rnd))

            def route(name: str):
                def go(reqs, on_record=progress.record):
                    return runner.run(None, reqs, concurrency=c, clients=min(a.clients, c), on_record=on_record,
                                      openai=urls[name], model=models[name])
                return go

            routes = {"npuserve": route("npuserve"), "llama.cpp": route("llama.cpp")}
            warm = requests(1000, min(c, 4), LengthDist("fixed", 2))
            for go in routes.values():  # untimed: first connections and first requests of each engine
                go(warm, None)
            rows = paired.run_rounds(routes, requests, a.rounds, extra={"concurrency": c, "threads": a.threads},
                                     on_start=lambda s: progress.point(f"c={c} {s}"))
    finally:
        if peer is not None:
            peer.stop()
    return rows, paired.compare(rows, "npuserve", "llama.cpp", TARGETS, extra={"concurrency": c})


def main(argv: list[str]) -> int:
    from tools.bench import Progress
    from tools.bench_peer import default_package
    from tools.load import paired
    from workers.gguf_package import GgufPackage
    from workers.package_loader import load_package

    a = parse_args(argv)
    from tools.bench_peer import _interrupt
    import signal

    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C: both servers are stopped
    pkg = load_package(a.package or default_package())
    if not isinstance(pkg, GgufPackage):
        print(f"npuserve bench-http-peer: {pkg.path} is not a GGUF package; import one with "
              f"`npuserve import-gguf`", file=sys.stderr)
        return 2
    if a.scenario:
        from tools.bench_scenario import peer_main

        return peer_main(a, pkg)
    total = sum(2 * a.rounds * c * a.per_stream for c in a.concurrencies)
    progress = Progress(total, not a.no_progress)
    rows: list[dict] = []
    comparison: list[dict] = []
    try:
        for c in a.concurrencies:
            r, cmp = run_concurrency(a, pkg, c, progress)
            rows += r
            comparison += cmp
    finally:
        progress.close()
    title = (f"bench-http-peer: {pkg.name}, {a.threads} thread(s) each, prompt {a.prompt_dist}, output "
             f"{a.output_dist}, greedy, ignore_eos, {a.rounds} rounds; npuserve = daemon + HTTP front, "
             f"llama.cpp = its own server; both over HTTP")
    return paired.report("bench-http-peer", title, rows, comparison, a.json,
                         {"package": pkg.name, "threads": a.threads})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
