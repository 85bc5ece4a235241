"""`npuserve bench serve choices`: what `n` > 1 costs the time to first token, against `n` = 1.

It starts one daemon (`ref` by default) and sends the same requests, round
after round in alternating order (`tools/load/paired.alternate`), as:

* `n=1`: one choice each (the baseline);
* `n=N` (`--n`, default 4): N choices each, on the wire's `n`.

A request's TTFT is from its send to the first token of its *last* choice
to start (every choice has begun streaming), so it counts the choices that
wait for choice 0's prompt and then fork its KV (docs/protocol.md "Several
choices"). Target: `n=N` TTFT P50 <= 1.2x `n=1`'s, on the medians over
rounds (each round's own ratio beside it). Also printed: the daemon's
`prefill_tokens` over each side's run beside its prompts' length: equal
for both sides when the backend copies (or forks) blocks, each prompt
computed once. `--json`: JSON Lines (`kind`: row, summary).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time

from tools.bench.options import add

TTFT_MAX_RATIO = 1.2


def parse_args(argv: list[str]) -> argparse.Namespace:
    from tools.load.workload import LengthDist

    p = argparse.ArgumentParser(prog="npuserve bench serve choices", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("ref", "stub", "sim", "ctypes", "llamacpp"), default="ref")
    p.add_argument("--n", type=int, default=4, help="choices per request of the subject side (default 4)")
    p.add_argument("--concurrency", type=int, default=2, help="requests outstanding at once (default 2)")
    p.add_argument("--requests", type=int, default=8, help="requests per side and round (default 8)")
    p.add_argument("--prompt", default="fixed:100", help="prompt lengths, as `npuserve bench` (default fixed:100)")
    p.add_argument("--output", default="fixed:16", help="output lengths (max_tokens), as `npuserve bench`")
    add(p, "set", "backend-option", "json", "no-progress", rounds=3, seed=42)
    a = p.parse_args(argv)
    try:
        a.prompt_dist, a.output_dist = LengthDist.parse(a.prompt), LengthDist.parse(a.output)
    except ValueError as e:
        p.error(str(e))
    if a.n < 2 or a.n > 16:
        p.error("--n must be 2..16")
    if min(a.concurrency, a.requests, a.rounds) < 1:
        p.error("--concurrency, --requests and --rounds must be positive")
    return a


async def _one(ac, req, n: int, on_record):
    """One request: its Record, `first` = when the last of its n choices sent its first token."""
    from tools.load.runner import Record

    msg = {"v": 1, "op": "generate", "id": ac.new_id(), "prompt": req.prompt, **req.wire()}
    if n > 1:
        msg["n"] = n
    firsts: dict[int, float] = {}
    tokens, error, last = 0, None, None
    sent = time.monotonic()
    batches = ac.choice_batches(msg, timeout=600) if n > 1 else ac.stream_batches(msg, timeout=600)
    async for batch in batches:
        now = time.monotonic()
        for ev in batch:
            if ev.get("ev") == "tokens" and ev.get("tokens"):
                firsts.setdefault(ev.get("index", 0), now)
                tokens += len(ev["tokens"])
                last = now
            elif ev.get("ev") == "error":
                error = ev.get("code", 500)
    first = max(firsts.values()) if len(firsts) == n else None
    rec = Record(index=req.index, tenant=req.tenant, sent=sent, first=first, last=last or first, tokens=tokens,
                 error=error if error is not None else (None if first is not None else 500))
    if on_record:
        on_record(rec)
    return rec


def _drive(endpoint: str, reqs, n: int, concurrency: int, on_record) -> list:
    from engine.async_client import AsyncClient

    async def main():
        sem = asyncio.Semaphore(concurrency)
        async with AsyncClient(endpoint, timeout=600) as ac:
            async def go(r):
                async with sem:
                    return await _one(ac, r, n, on_record)
            return await asyncio.gather(*(go(r) for r in reqs))

    return asyncio.run(main())


def run(a: argparse.Namespace, progress) -> tuple[list[dict], dict]:
    from engine.client import Client
    from tools.load import local_daemon, paired
    from tools.load.workload import WorkloadSpec, build

    d = local_daemon.start(backend=a.backend, chips=1, settings=["admission.deadline_default_ms=3600000", *a.set],
                           backend_options=a.backend_option, prefix="npc-")
    prefill: dict[str, list[tuple[int, int]]] = {}  # side -> per round: (prefill_tokens, prompt tokens)
    try:
        model = local_daemon.wait_healthy(d.endpoint, d, timeout=300)["model"]

        def requests(rnd: int, count: int = a.requests):
            return build(WorkloadSpec(count, a.prompt_dist, a.output_dist, vocab=min(model["vocab_size"], 256),
                                      max_seq=model["max_seq"], seed=a.seed + rnd))

        def counters() -> dict:
            with Client(d.endpoint, timeout=30) as c:
                return c.stats()["scheduler"]["counters"]

        def route(n: int):
            def go(reqs):
                # the sides' prompts differ in their first token: neither finds the other's in the prefix cache
                reqs = [dataclasses.replace(r, prompt=[n, *r.prompt[1:]]) for r in reqs]
                before = counters()["prefill_tokens"]
                recs = _drive(d.endpoint, reqs, n, a.concurrency, progress.record)
                prefill.setdefault(f"n={n}", []).append((counters()["prefill_tokens"] - before,
                                                         sum(len(r.prompt) for r in reqs)))
                return recs
            return go

        _drive(d.endpoint, requests(1000, 2), a.n, 1, None)  # untimed: first connection, first jobs
        rows = paired.run_rounds({f"n={a.n}": route(a.n), "n=1": route(1)}, requests, a.rounds,
                                 extra={"backend": a.backend, "concurrency": a.concurrency},
                                 on_start=progress.point)
    finally:
        d.stop()
        d.cleanup()
    for row in rows:  # the board's prompt work beside the prompts' own length (equal: each prompt computed once)
        row["prefill_tokens"], row["prompt_tokens"] = prefill[row["label"]][row["round"] - 1]
    return rows, {"backend": a.backend, "n": a.n, "concurrency": a.concurrency}


def main(argv: list[str]) -> int:
    from tools.load import paired
    from tools.load.progress import Progress

    a = parse_args(argv)
    progress = Progress(a.rounds * 2 * a.requests, not (a.json or a.no_progress))
    try:
        rows, summary = run(a, progress)
    finally:
        progress.close()
    subject = f"n={a.n}"
    comparison = paired.compare(rows, subject, "n=1", [paired.Target("ttft_p50_ms", "max", TTFT_MAX_RATIO)],
                                extra={"concurrency": a.concurrency},
                                metrics=("ttft_p50_ms", "ttft_p99_ms", "tokens_per_s", "prefill_tokens"))
    title = (f"bench-choices: {a.backend} backend, {a.requests} requests per side and round at concurrency "
             f"{a.concurrency}, prompt {a.prompt_dist}, output {a.output_dist}, {a.rounds} rounds; TTFT of {subject} "
             f"= until its last choice's first token (target: TTFT P50 <= {TTFT_MAX_RATIO:g}x n=1's)")
    return paired.report("bench-choices", title, rows, comparison, a.json, summary)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
