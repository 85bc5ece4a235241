"""`npuserve bench serve point`: the end-to-end serving benchmark, a preset of `npuserve bench serve`.

One closed-loop point at `--concurrency` streamed requests with the simulator's
gaussian lengths (`normal:P,200` prompts, `normal:G,50` outputs), from several
client processes through `AsyncClient`. Reports delivered generated tokens/s
and TTFT / TPOT percentiles measured at the client; for the `sim` backend also
what the in-process simulator predicts for the same requests, and what the
chips did in both runs.

`--compare-framing` runs the same requests against one daemon from clients
that ask for batched events (`hello`) and from clients that do not (one
event per message, the v1 default), rounds alternating, and prints
what the opt-in saves: tokens/s and the daemon's CPU per token.
"""

from __future__ import annotations

import argparse
import sys

from tools.bench.options import add
from tools.bench.serve import load as bench


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve bench serve point", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("stub", "sim", "ref"), default="stub")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, help="total requests (default: a few per concurrency slot)")
    p.add_argument("--prompt-mean", type=int, help="mean prompt tokens")
    p.add_argument("--gen-mean", type=int, help="mean generated tokens")
    p.add_argument("--chips", type=int, default=2)
    add(p, clients=2)
    p.add_argument("--endpoint", help="benchmark an already running daemon instead of starting one")
    p.add_argument("--max-inflight", type=int, default=2,
                   help="executor.max_inflight of the daemon (default 2: ping/pong hides the host round trip)")
    add(p, "set", "backend-option")
    p.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `npuserve serve`, e.g. --daemon-arg=--trace=/tmp/t.json")
    p.add_argument("--compare-framing", action="store_true",
                   help="batched-events clients vs one-event-per-message clients on one daemon, rounds alternating")
    add(p, "json", rounds=3, helps={"rounds": "with --compare-framing: paired rounds"})
    return p.parse_args(argv)


# The opt-in exists to save the daemon work: batched clients must not come out slower (tokens/s ratio >= 1).
FRAMING_TARGET_MIN = 1.0


def compare_framing(a: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Paired rounds of the preset's requests, batched vs one event per message, on one daemon started here."""
    import psutil

    from tools.load import local_daemon, paired, runner
    from tools.load.progress import Progress
    from tools.load.workload import WorkloadSpec, build

    ba = bench.parse_args(bench_argv(a), prog="npuserve bench serve point")
    n = ba.requests or a.concurrency * 4
    progress = Progress(a.rounds * 2 * n, not (a.json or ba.no_progress))
    settings = [f"executor.max_inflight={a.max_inflight}", *a.set]
    d = local_daemon.start(backend=a.backend, chips=a.chips, settings=settings, backend_options=a.backend_option,
                           prefix="npf-", extra=a.daemon_arg)
    try:
        model = local_daemon.wait_healthy(d.endpoint, d)["model"]
        proc = psutil.Process(d.pid)

        def requests(rnd: int):
            return build(WorkloadSpec(n, ba.prompt_dist, ba.output_dist, vocab=min(model["vocab_size"], 256),
                                      max_seq=model["max_seq"], seed=ba.seed + rnd))

        cpu_per_token: dict[tuple[str, int], float] = {}

        def route(batched: bool):
            label = "batched" if batched else "one_per_message"

            def go(reqs):
                cpu = proc.cpu_times()
                recs = runner.run(d.endpoint, reqs, concurrency=a.concurrency, clients=a.clients,
                                  on_record=progress.record, batched_events=batched)
                used = sum(proc.cpu_times()[:2]) - sum(cpu[:2])
                tokens = sum(r.tokens for r in recs)
                cpu_per_token[(label, len([k for k in cpu_per_token if k[0] == label]) + 1)] = \
                    round(1e6 * used / max(tokens, 1), 2)
                return recs
            return go

        rows = paired.run_rounds({"batched": route(True), "one_per_message": route(False)}, requests, a.rounds,
                                 extra={"backend": a.backend, "concurrency": a.concurrency}, on_start=progress.point)
        for r in rows:
            r["daemon_cpu_us_per_token"] = cpu_per_token.get((r["label"], r["round"]))
    finally:
        progress.close()
        d.stop()
        d.cleanup()
    targets = [paired.Target("tokens_per_s", "min", FRAMING_TARGET_MIN)]
    comparison = paired.compare(rows, "batched", "one_per_message", targets,
                                extra={"backend": a.backend, "concurrency": a.concurrency},
                                metrics=(*paired.METRICS, "daemon_cpu_us_per_token"))
    return rows, comparison


def bench_argv(a: argparse.Namespace) -> list[str]:
    """The `npuserve bench` command line this preset stands for."""
    _, prompt, output = bench.DEFAULTS[a.backend]
    pm = a.prompt_mean or int(float(prompt.split(":")[1].split(",")[0]))
    gm = a.gen_mean or int(float(output.split(":")[1].split(",")[0]))
    out = ["--backend", a.backend, "--concurrency", str(a.concurrency), "--chips", str(a.chips),
           "--clients", str(a.clients), "--max-inflight", str(a.max_inflight),
           "--prompt", f"normal:{pm},200", "--output", f"normal:{gm},50"]
    if a.requests:
        out += ["--requests", str(a.requests)]
    if a.endpoint:
        out += ["--endpoint", a.endpoint]
    for kv in a.set:
        out += ["--set", kv]
    for kv in a.backend_option:
        out += ["--backend-option", kv]
    for arg in a.daemon_arg:
        out.append(f"--daemon-arg={arg}")
    if a.json or not sys.stderr.isatty():
        out.append("--no-progress")
    return out


def run(a: argparse.Namespace) -> dict:
    """The measured row of this preset (the simulator's prediction rides in it for `sim`)."""
    ba = bench.parse_args(bench_argv(a), prog="npuserve bench serve point")
    rows, _ = bench.run(ba)
    res = next(r for r in rows if not r["label"].startswith("predicted"))
    res["prompt_mean"], res["gen_mean"] = ba.prompt_dist.a, ba.output_dist.a
    return res


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.compare_framing:
        from tools.load import paired

        rows, comparison = compare_framing(a)
        title = (f"bench-serve --compare-framing: {a.backend} backend, {a.chips} chips, {a.concurrency} streams, "
                 f"{a.rounds} rounds; batched = clients that sent hello with batched_events, one_per_message = "
                 f"clients that did not (target: batched tokens/s >= {FRAMING_TARGET_MIN:g}x)")
        return paired.report("bench-serve", title, rows, comparison, a.json,
                             {"backend": a.backend, "concurrency": a.concurrency})
    from tools.load.report import publish

    res = run(a)

    def text() -> str:
        out = [f"bench-serve: {a.backend} backend, {a.chips} chips, concurrency {a.concurrency}, "
               f"{res['requests']} requests ({res['errors']} errors), {res['generated_tokens']} tokens "
               f"in {res['seconds']} s", f"  generated tokens/s  {res['tokens_per_s']}"]
        if res["predicted_tokens_per_s"] is not None:
            pct = 100 * res["tokens_per_s"] / res["predicted_tokens_per_s"]
            out.append(f"  predicted tokens/s  {res['predicted_tokens_per_s']}  (delivered {pct:.1f} %)")
        out += [f"  TTFT p50/p99 ms     {res['ttft_p50_ms']} / {res['ttft_p99_ms']}",
                f"  TPOT p50/p99 ms     {res['tpot_p50_ms']} / {res['tpot_p99_ms']}"]
        for label, ran in (("daemon", res["daemon_run"]), ("simulator", res["predicted_run"])):
            if ran is not None:
                busy = ", ".join(f"{100 * b:.1f} %" for b in ran["device_busy"])
                out.append(f"  {label + ':':<11} {ran['window_s']} s, device busy per chip {busy}; "
                           f"{ran['decode_jobs']} decode jobs ({ran['mean_decode_lanes']} lanes), "
                           f"{ran['prefill_jobs']} prefill jobs")
        out.append(f"  (= npuserve bench serve {' '.join(bench_argv(a))})")
        return "\n".join(out)

    return publish("bench-serve", a.json, [("row", res)], text, [res])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
