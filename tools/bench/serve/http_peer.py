"""`npuserve bench serve http-peer`: npuserve against llama.cpp's own server, both over HTTP, on the same GGUF.

It starts both servers itself: llama.cpp's server (xllamacpp, llama.cpp's
HTTP server and slots; `--parallel` = the concurrency) and an npuserve daemon
on the `llamacpp` backend with its HTTP front, each with the same CPU
threads, and drives both with the same requests (`npuserve bench --openai`:
streamed `/v1/completions`, token-id prompts, greedy, `ignore_eos`), round
after round in alternating order, fresh servers for every concurrency. It
prints the runs, the npuserve / llama.cpp ratios of the medians, and the
distance from bench-peer's targets (tokens/s >= 1.0x, TTFT P99 <= 1.0x),
here with both servers' HTTP layers in the path.

`--conversations N --turns T` runs the multi-turn conversation workload
instead (`tools.load.conversation_http`: each turn's prompt is the whole
conversation so far plus a new message) against llama.cpp's server with its
host prompt cache (`--cache-ram`, its default 8192 MiB) and npuserve with the
same KV capacity on the chip (`kv.num_blocks` = llama.cpp's context, unless
`--device-blocks`); per run TTFT P50/P99 and the prompt tokens each computed,
and its targets (docs/benchmarks.md): TTFT P50 <= 0.7x llama.cpp's and fewer
prompt tokens computed. npuserve runs on its device prefix cache alone unless
`--set kv.host_pool_mb=N` adds the board's host tier (the `llamacpp`
backend's KV export/import).
"""

from __future__ import annotations

import argparse
import sys

from tools.bench.options import THREADS, add
from tools.load.paired import Target

TARGETS = [Target("tokens_per_s", "min", 1.0), Target("ttft_p99_ms", "max", 1.0)]
CONVERSATION_TARGETS = [Target("ttft_p50_ms", "max", 0.7), Target("prompt_tokens_computed", "max", 1.0)]
CONVERSATION_METRICS = ("ttft_p50_ms", "ttft_p99_ms", "ttft_p50_later_turns_ms", "prompt_tokens_computed")


def parse_args(argv: list[str]) -> argparse.Namespace:
    from tools.load.workload import LengthDist

    p = argparse.ArgumentParser(prog="npuserve bench serve http-peer", description=__doc__.split("\n\n")[0])
    add(p, "package", threads=THREADS)
    p.add_argument("--concurrency", default="1,8", help="streams outstanding at once, a list (default 1,8)")
    p.add_argument("--per-stream", type=int, default=2, help="requests per stream")
    p.add_argument("--prompt", default="fixed:64", help="prompt lengths, as `npuserve bench`")
    p.add_argument("--output", default="fixed:32", help="output lengths, as `npuserve bench`")
    add(p, rounds=2, clients=1, seed=42)
    g = p.add_argument_group("conversations (--conversations N: the multi-turn workload instead)")
    g.add_argument("--conversations", type=int, default=0, help="this many conversations ...")
    g.add_argument("--turns", type=int, default=4, help="... of this many turns each")
    g.add_argument("--first-len", type=int, default=256, help="tokens of a conversation's first message")
    g.add_argument("--turn-len", type=int, default=32, help="tokens of each later user message")
    g.add_argument("--answer-len", type=int, default=16, help="max_tokens of every turn (and the assistant's "
                                                             "tokens in the history)")
    g.add_argument("--device-blocks", type=int, default=0, help="npuserve's kv.num_blocks (default: llama.cpp's "
                                                                "context in 16-token blocks)")
    g.add_argument("--cache-ram", type=int, default=None, help="llama.cpp's --cache-ram MiB (default: its own)")
    add(p, "set")
    p.add_argument("--scenario", metavar="NAME",
                   help="a head-to-head scenario instead of uniform load: long-prompt, tenant-flood, burst, hangups "
                        "(tools/load/scenarios.py; docs/benchmarks.md)")
    p.add_argument("--scenario-option", action="append", default=[], metavar="KEY=VALUE", help="a scenario size")
    p.add_argument("--slots", type=int, default=8,
                   help="with --scenario: llama.cpp's slots = npuserve's admission.max_sequences (default 8)")
    add(p, "plot", helps={"plot": "with --scenario: its plot (long-prompt, tenant-flood)"})
    p.add_argument("--records", metavar="FILE.jsonl", help="with --scenario: every request's record")
    add(p, "json", "no-progress")
    a = p.parse_args(argv)
    try:
        a.concurrencies = [int(x) for x in a.concurrency.split(",") if x.strip()]
        a.prompt_dist, a.output_dist = LengthDist.parse(a.prompt), LengthDist.parse(a.output)
    except ValueError as e:
        p.error(str(e))
    if not a.concurrencies or min(a.concurrencies + [a.threads, a.per_stream, a.rounds, a.clients, a.slots]) < 1:
        p.error("--concurrency, --threads, --per-stream, --rounds, --clients and --slots must be positive")
    if a.conversations and min(a.turns, a.first_len, a.turn_len, a.answer_len) < 1:
        p.error("--turns, --first-len, --turn-len and --answer-len must be positive")
    if a.scenario:
        from tools.bench.serve.scenario import options_of
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


def run_conversations(a: argparse.Namespace, pkg, c: int, progress) -> tuple[list[dict], list[dict]]:
    """The conversation workload on both servers, fresh for this concurrency, rounds in alternating order
    (each round new conversations, so neither server has seen them)."""
    from types import SimpleNamespace

    from tools.load import conversation_http as conv
    from tools.load import llamacpp_server, local_front, paired
    from tools.load.openai_load import probe

    spec = conv.ConversationSpec(a.conversations, a.turns, a.first_len, a.turn_len, a.answer_len, seed=a.seed)
    ctx = spec.max_len() + 16
    blocks = a.device_blocks or -(-c * ctx // 16)  # the KV llama.cpp's slots hold, in 16-token blocks
    settings = [f"model.package=\"{pkg.path}\"", f"board.threads_per_chip={a.threads}", "executor.max_inflight=1",
                "admission.deadline_default_ms=3600000", f"kv.num_blocks={blocks}", *a.set]
    peer = None
    try:
        with local_front.daemon_and_front("bench-http-peer", backend="llamacpp", chips=1, settings=settings,
                                          prefix="npp-") as (_d, front, _model):
            peer = llamacpp_server.start(pkg.gguf_path, threads=a.threads, parallel=c, ctx_per_slot=ctx,
                                         cache_ram_mib=a.cache_ram)
            urls = {"npuserve": front.url, "llama.cpp": peer.url}
            models = {k: probe(u)["id"] for k, u in urls.items()}
            warm = conv.build(conv.ConversationSpec(min(c, 2), 1, 8, 1, 2, seed=a.seed + 999))
            for k in urls:  # untimed: first connections and first requests of each engine
                conv.run(urls[k], models[k], warm, c, 2)
            convs_of = paired.per_round(lambda rnd: conv.build(conv.ConversationSpec(
                **{**spec.__dict__, "seed": a.seed + 1000 * c + rnd})))

            def run(label: str, rnd: int, _group) -> dict:
                convs = convs_of(rnd)
                progress.point(f"c={c} round {rnd + 1}/{a.rounds}: {label}")
                recs = conv.run(urls[label], models[label], convs, c, a.answer_len,
                                on_record=lambda r: progress.record(SimpleNamespace(tokens=a.answer_len,
                                                                                    error=r["error"])))
                return {"label": label, "round": rnd + 1, "concurrency": c, "threads": a.threads,
                        "device_blocks": blocks if label == "npuserve" else None,
                        "cache_ram_mib": a.cache_ram if label == "llama.cpp" else None, **conv.summarize(recs)}

            rows = paired.alternate(list(urls), a.rounds, run)
    finally:
        if peer is not None:
            peer.stop()
    return rows, paired.compare(rows, "npuserve", "llama.cpp", CONVERSATION_TARGETS, extra={"concurrency": c},
                                metrics=CONVERSATION_METRICS)


CONVERSATION_COLUMNS = [("label", "engine"), ("round", "round"), ("concurrency", "c"), ("requests", "requests"),
                        ("errors", "errors"), ("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
                        ("ttft_p50_later_turns_ms", "later p50"), ("prompt_tokens_computed", "computed"),
                        ("prompt_tokens", "of prompt"), ("hit_rate", "hit rate")]


def per_concurrency(a: argparse.Namespace, run, total: int) -> tuple[list[dict], list[dict]]:
    """`run(c, progress)` -> (rows, comparison) for every concurrency of `a`, one progress bar over all."""
    from tools.load.progress import Progress

    progress = Progress(total, not a.no_progress)
    rows: list[dict] = []
    comparison: list[dict] = []
    try:
        for c in a.concurrencies:
            r, cmp = run(c, progress)
            rows += r
            comparison += cmp
    finally:
        progress.close()
    return rows, comparison


def conversations_main(a: argparse.Namespace, pkg) -> int:
    from tools.load import paired
    from tools.load.report import publish, table

    rows, comparison = per_concurrency(a, lambda c, progress: run_conversations(a, pkg, c, progress),
                                       sum(2 * a.rounds * a.conversations * a.turns for _ in a.concurrencies))
    met = [x["met"] for x in comparison if "met" in x]
    summary = {"package": pkg.name, "threads": a.threads, "workload": "conversations",
               "conversations": a.conversations, "turns": a.turns, "npuserve_kv": "device prefix cache"
               if not any(s.startswith("kv.host_pool_mb") for s in a.set) else "with host tier",
               "comparison": comparison, "targets_met": all(met) if met else None}

    def text() -> str:
        out = [f"bench-http-peer --conversations: {pkg.name}, {a.conversations} conversations x {a.turns} turns "
               f"(first {a.first_len}, then {a.turn_len} + {a.answer_len}-token answers), {a.threads} thread(s) "
               f"each, greedy, {a.rounds} rounds; llama.cpp with its host prompt cache (--cache-ram "
               f"{a.cache_ram if a.cache_ram is not None else 'default'}), npuserve on its device prefix cache"
               f"{'' if not a.set else ' + ' + ', '.join(a.set)}",
               table(rows, CONVERSATION_COLUMNS),
               "(TTFT in ms at the client, over HTTP; npuserve against llama.cpp on the medians over rounds)"]
        for c in a.concurrencies:
            out += [f" concurrency {c}:", paired.format_comparison([x for x in comparison if x.get("concurrency") == c])]
        return "\n".join(out)

    return publish("bench-http-peer", a.json, [*(("row", r) for r in rows), ("summary", summary)], text, rows)


def main(argv: list[str]) -> int:
    from tools.bench.gguf import load_gguf
    from tools.load import paired

    a = parse_args(argv)
    from tools.bench.serve.peer import _interrupt
    import signal

    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C: both servers are stopped
    pkg = load_gguf(a.package, "npuserve bench serve http-peer")
    if a.conversations:
        return conversations_main(a, pkg)
    if a.scenario:
        from tools.bench.serve.scenario import peer_main

        return peer_main(a, pkg)
    rows, comparison = per_concurrency(a, lambda c, progress: run_concurrency(a, pkg, c, progress),
                                       sum(2 * a.rounds * c * a.per_stream for c in a.concurrencies))
    title = (f"bench-http-peer: {pkg.name}, {a.threads} thread(s) each, prompt {a.prompt_dist}, output "
             f"{a.output_dist}, greedy, ignore_eos, {a.rounds} rounds; npuserve = daemon + HTTP front, "
             f"llama.cpp = its own server; both over HTTP")
    return paired.report("bench-http-peer", title, rows, comparison, a.json,
                         {"package": pkg.name, "threads": a.threads})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
