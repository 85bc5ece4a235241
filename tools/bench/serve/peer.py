"""`npuserve bench serve peer`: npuserve (llamacpp backend) against llama.cpp's own server engine, side by side.

The same GGUF, the same total CPU threads, the same workload (prompt and
output lengths, greedy, `ignore_eos`), in alternating runs: an npuserve
daemon with the `llamacpp` backend driven in-process through the async
client library (`tools.load.runner.run_here`), then llama.cpp's server
engine (xllamacpp `Server`, `n_parallel` = concurrency, continuous batching)
driven in-process by one thread per stream, then again in the other order.
Each engine gets a fresh process / server per run. TTFT and TPOT are
measured at the caller for both.

Workloads: `plain` (distinct prompts) and, with `--shared-prefix`,
`shared-prefix` (a few long system prompts, each followed by a short
per-user question; each engine sees every system prompt once before the
timed run), where npuserve's radix prefix cache should cut TTFT.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass

from tools.bench.options import THREADS, add
from tools.json_lines import emit
from tools.load import chip_runs, local_daemon, paired, runner
from tools.load.report import publish, summarize, table
from tools.load.runner import Record
from tools.load.workload import Request

TARGETS = {  # (metric, workload, concurrency): npuserve / llama.cpp at least (min) / at most (max) the bound
    ("tokens_per_s", "plain", 8): paired.Target("tokens_per_s", "min", 1.0),
    ("tokens_per_s", "plain", 32): paired.Target("tokens_per_s", "min", 1.0),
    ("ttft_p99_ms", "plain", 32): paired.Target("ttft_p99_ms", "max", 1.0),
    ("ttft_p50_ms", "shared-prefix", 32): paired.Target("ttft_p50_ms", "max", 0.5),
}
METRICS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
COLUMNS = [("engine", "engine"), ("concurrency", "conc"), ("workload", "workload"), ("round", "round"),
           ("tokens_per_s", "tok/s"), ("ttft_p50_ms", "ttft p50"), ("ttft_p99_ms", "ttft p99"),
           ("tpot_p50_ms", "tpot p50"), ("tpot_p99_ms", "tpot p99"), ("chip_busy", "chip busy")]
_TEXT = ("The history of the city begins with a small settlement on the river. Over the centuries it grew into a "
         "center of trade, learning and art, attracting merchants, scholars and travelers from distant lands. ")


@dataclass
class Row:
    engine: str
    concurrency: int
    workload: str
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    round: int
    # npuserve: the chip workers' device time over the timed run (stats deltas; target >= 0.97 at 8 and 32 streams)
    chip_busy: float | None = None


def _row(engine: str, c: int, workload: str, rnd: int, records: list[Record]) -> Row:
    s = summarize(records)
    return Row(engine, c, workload, s["tokens_per_s"], *(s[m] or 0.0 for m in METRICS[1:]), rnd)


def make_prompts(tok, workload: str, n: int, prompt_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, warm-up prompts): `prompt_tokens` distinct tokens (plain, no warm-up), or one of 4 shared
    system prompts + a short question (shared-prefix; each engine sees every system prompt once, untimed)."""
    body = tok.encode(_TEXT * (2 + 3 * prompt_tokens // 40))[1:]
    bos = [tok.bos_id] if tok.add_bos else []
    if workload == "plain":
        return [bos + [body[(i * 7) % 50]] + body[i % 40: i % 40 + prompt_tokens - 1 - len(bos)] for i in range(n)], []
    systems = [bos + tok.encode(f"System prompt {k}. ")[1:] + body[k * 13: k * 13 + prompt_tokens] for k in range(4)]
    return [systems[i % 4] + tok.encode(f" User {i} asks: what happened in year {1000 + i}?")[1:] for i in range(n)], \
        systems


# ---------------------------------------------------------------- npuserve

def run_npuserve(a, package: str, prompts: list[list[int]], warm: list[list[int]], out_tokens: int, c: int,
                 workload: str, rnd: int) -> Row:
    from engine.client import Client

    settings = [f"model.package=\"{package}\"", f"board.threads_per_chip={max(1, a.threads // a.chips)}",
                "executor.max_inflight=1", "admission.deadline_default_ms=3600000", *a.set]
    d = local_daemon.start(backend="llamacpp", chips=a.chips, settings=settings, prefix="npb-")
    endpoint = d.endpoint
    try:
        local_daemon.wait_healthy(endpoint, d, timeout=300)
        with Client(endpoint, timeout=900) as cl:
            for p in warm:
                cl.generate(p, max_tokens=1, temperature=0.0)
        reqs = [Request(i, p, out_tokens, seed=i, extra={"temperature": 0.0}) for i, p in enumerate(prompts)]
        before, t0 = local_daemon.stats(endpoint), time.monotonic()
        records = runner.run_here(endpoint, reqs, concurrency=c, timeout=900)
        ran = chip_runs.daemon_run(before, local_daemon.stats(endpoint), time.monotonic() - t0)
    except BaseException:
        print(f"npuserve daemon log (tail):\n{d.log_tail()}", file=sys.stderr)
        raise
    finally:
        d.stop(60)
        if os.environ.get("NPUSERVE_BENCH_KEEP"):
            print(f"daemon log kept in {d.log_path}", file=sys.stderr)
        else:
            d.cleanup()
    row = _row("npuserve", c, workload, rnd, records)
    row.chip_busy = round(sum(ran["device_busy"]) / max(len(ran["device_busy"]), 1), 4)
    return row


# ---------------------------------------------------------------- llama.cpp's server engine

def run_llamacpp_server(a, gguf: str, prompts: list[list[int]], warm: list[list[int]], out_tokens: int, c: int,
                        workload: str, rnd: int, tune=None, engine: str = "llama.cpp") -> Row:
    """`tune(params)`: further settings of the server's CommonParams (bench-spec: its speculative decoding)."""
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = gguf
    p.n_parallel = c
    p.n_ctx = c * (max(len(x) for x in prompts) + out_tokens + 16)
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = a.threads
    p.warmup = False
    p.verbosity = -1
    if tune is not None:
        tune(p)
    server = xlc.Server(p)
    records: list[Record] = []
    lock = threading.Lock()
    queue = list(reversed(list(enumerate(prompts))))

    def stream_worker():
        while True:
            with lock:
                if not queue:
                    return
                index, prompt = queue.pop()
            stamps: list[float] = []

            def on_event(ev, stamps=stamps):
                if isinstance(ev, dict) and ev.get("choices") and ev["choices"][0].get("text") is not None \
                        and ev["choices"][0].get("finish_reason") is None:
                    stamps.append(time.time())

            t = time.time()
            server.handle_completions({"prompt": prompt, "n_predict": out_tokens, "temperature": 0.0,
                                       "ignore_eos": True, "stream": True}, on_event)
            with lock:  # an event may carry several tokens (a UTF-8 character held back); ignore_eos: all of them
                records.append(Record(index, "default", t, stamps[0] if stamps else None,
                                      stamps[-1] if stamps else None, out_tokens if stamps else 0, None))

    try:
        for w in warm:
            server.handle_completions({"prompt": w, "n_predict": 1, "temperature": 0.0, "stream": False})
        threads = [threading.Thread(target=stream_worker) for _ in range(c)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        server = None  # stops llama.cpp's server loop and frees the model
    return _row(engine, c, workload, rnd, records)


# ---------------------------------------------------------------- report

def ratio_rows(rows: list[Row]) -> list[dict]:
    """npuserve / llama.cpp per metric on the medians over rounds, with each round's own ratio beside it.

    Both engines run the same requests back to back in a round, so a round's
    ratio is a paired measurement; their spread is how far the machine's
    drift alone moves the ratio. A target whose bound lies inside that spread
    is flagged `within_spread`: the verdict on the median is then a coin
    flip between runs, and the note should say "parity", not "met" or "missed".
    """
    out = []
    for workload, c in sorted({(r.workload, r.concurrency) for r in rows}):
        runs = [{"label": r.engine, **asdict(r)} for r in rows if (r.workload, r.concurrency) == (workload, c)]
        if not {"npuserve", "llama.cpp"} <= {r["label"] for r in runs}:
            continue
        ours, peer = paired.medians(runs, "npuserve", METRICS), paired.medians(runs, "llama.cpp", METRICS)
        for metric in METRICS:
            if not peer[metric]:
                continue
            ratio = ours[metric] / peer[metric]
            per_round = paired.round_values(runs, "npuserve", "llama.cpp", metric, diff=False)
            row = {"ratio": metric, "workload": workload, "concurrency": c, "npuserve_over_llama_cpp": round(ratio, 3),
                   "round_ratios": per_round}
            t = TARGETS.get((metric, workload, c))
            if t:
                row.update(target=f"{'>=' if t.kind == 'min' else '<='} {t.bound}", met=t.met(ratio),
                           distance=round(ratio - t.bound, 3), within_spread=paired.bound_within(per_round, t.bound))
            out.append(row)
    return out


def format_table(rows: list[Row], ratios: list[dict]) -> str:
    lines = [table([asdict(r) for r in rows], COLUMNS)]
    lines += ["", "npuserve / llama.cpp (median over rounds; in brackets the rounds' own ratios, lowest to highest):"]
    for x in ratios:
        spread = ""
        if len(x["round_ratios"]) > 1:
            spread = f" [{min(x['round_ratios']):.3f}-{max(x['round_ratios']):.3f}]"
        verdict = ""
        if "target" in x:
            verdict = f"  target {x['target']}: {'met' if x['met'] else 'MISSED by ' + str(abs(x['distance']))}"
            if x["within_spread"]:
                verdict += " (the bound lies inside the rounds' spread: parity)"
        lines.append(f"  {x['workload']:<13} c={x['concurrency']:<3} {x['ratio']:<13} {x['npuserve_over_llama_cpp']:.3f}"
                     + spread + verdict)
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C, so the running daemon is stopped


def main(argv: list[str]) -> int:

    signal.signal(signal.SIGTERM, _interrupt)

    ap = argparse.ArgumentParser(prog="npuserve bench serve peer", description=__doc__.split("\n\n")[0])
    add(ap, "package")
    ap.add_argument("--concurrency", type=_ints, default=[1, 8, 32])
    ap.add_argument("--shared-prefix", action="store_true", help="also run the shared-system-prompt workload")
    ap.add_argument("--only-shared-prefix", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--system-tokens", type=int, default=512, help="system prompt length (shared-prefix)")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=1)
    add(ap, threads=THREADS, helps={"threads": "total CPU threads of each engine"})
    ap.add_argument("--chips", type=int, default=1, help="npuserve chip workers (threads are split over them)")
    add(ap, "set", "json", rounds=2,
        helps={
            "set": "npuserve daemon config override, e.g. --set batch.mixed_batches=false",
        })
    a = ap.parse_args(argv)

    from tools.bench.gguf import load_gguf
    from workers.llamacpp.tokenizer import GgufTokenizer

    pkg = load_gguf(a.package, "npuserve bench serve peer")
    tok = GgufTokenizer(pkg.gguf_path)
    workloads = ([] if a.only_shared_prefix else ["plain"]) + (["shared-prefix"] if a.shared_prefix or a.only_shared_prefix else [])

    @functools.cache
    def prompts_of(workload: str, c: int) -> tuple[list[list[int]], list[list[int]]]:
        plen = a.prompt_tokens if workload == "plain" else a.system_tokens
        return make_prompts(tok, workload, c * a.requests_per_stream, plen)

    def run(engine: str, rnd: int, group: tuple[str, int]) -> Row:
        workload, c = group
        prompts, warm = prompts_of(workload, c)
        print(f"round {rnd + 1}/{a.rounds}: {engine} c={c} {workload} ...", file=sys.stderr, flush=True)
        if engine == "npuserve":
            row = run_npuserve(a, pkg.path, prompts, warm, a.output_tokens, c, workload, rnd)
        else:
            row = run_llamacpp_server(a, pkg.gguf_path, prompts, warm, a.output_tokens, c, workload, rnd)
        if a.json:
            emit("row", asdict(row))
        return row

    # npuserve first where round + concurrency is even
    rows = paired.alternate(("npuserve", "llama.cpp"), a.rounds, run,
                            groups=[(w, c) for w in workloads for c in a.concurrency],
                            flip=lambda rnd, group: (rnd + group[1]) % 2 == 1)
    ratios = ratio_rows(rows)
    tok.close()
    return publish("bench-peer", a.json, (("ratio", x) for x in ratios),
                   lambda: f"same GGUF ({pkg.name}), {a.threads} threads each, prompt {a.prompt_tokens} (shared-prefix: "
                           f"{a.system_tokens}-token system prompts), output {a.output_tokens}, greedy, ignore_eos\n"
                           + format_table(rows, ratios))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
