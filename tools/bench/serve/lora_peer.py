"""`npuserve bench serve lora --backend llamacpp`: a uniform mix of LoRA adapters on npuserve against llama.cpp's server.

The same GGUF base (default: Gemma 3 270M) and the same N LoRA GGUF adapters
(`make-lora`, default 4) on both servers, both over HTTP: an npuserve daemon
on the `llamacpp` backend (`--lora NAME=PATH` each) with its front, where a
request names its adapter as its `model`; and llama.cpp's own server with
every adapter loaded unapplied (`--lora` ... `--lora-init-without-apply`)
and a full-size sliding-window cache (`--swa-full`, as the backend keeps
it), where a request applies its adapter with its `lora` list. Each round runs
the same requests (text prompts, greedy, `ignore_eos`, request i under
adapter i mod N) at a fixed number of streams on three routes, in an order
that flips every round:

* `npuserve`: the mix on npuserve;
* `llama.cpp`: the mix on llama.cpp's server;
* `npuserve base`: the same requests on npuserve's base model, no adapter.

The row is npuserve's tokens/s over llama.cpp's on the mix (medians over
rounds), target >= 1.5x. Its bound is npuserve's base-only tokens/s over
llama.cpp's mix: a mix adds adapter work and (jobs grouped by adapter)
smaller jobs to the same tokens, so npuserve's mix cannot beat its own base
run. Before the timed rounds, an untimed pass (other prompts, also the
warm-up) sends the mix to both servers and the base requests to npuserve,
unstreamed, and counts the answers whose texts are equal on both servers
and those that differ from the base model's (the adapters apply).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from tools.load.paired import Target

TARGET = Target("tokens_per_s", "min", 1.5)
MIX, PEER, BASE = "npuserve", "llama.cpp", "npuserve base"
METRICS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
STRENGTH = 0.3  # the adapters' update against the base matrices (make-lora): changes the text, keeps it language
_TEXT = ("The history of the city begins with a small settlement on the river. Over the centuries it grew into a "
         "center of trade, learning and art, attracting merchants, scholars and travelers from distant lands. "
         "Its markets sold spices, cloth and books; its schools taught law, medicine and astronomy. ")


def prompts(tok, count: int, length: int, salt: int) -> list[list[int]]:
    """`count` token prompts of at most `length` tokens: a distinct opening (so no prefix is shared between
    requests or rounds), then a window of ordinary text."""
    words = (_TEXT * (2 + length // 20)).split()
    out = []
    for i in range(count):
        start = (i * 7) % 40
        ids = tok.encode(f"Note {salt}-{i}. " + " ".join(words[start:start + length]))
        out.append(ids[:length])
    return out


def _lora_list(n: int, k: int) -> list[dict]:
    """llama.cpp's per-request adapter selection: adapter k at full scale, every other loaded one off."""
    return [{"id": j, "scale": 1.0 if j == k else 0.0} for j in range(n)]


def _route_fields(route: str, i: int, names: list[str]) -> dict:
    """What request i adds on `route`: its adapter (i mod N) as npuserve's model or llama.cpp's `lora` list."""
    if route == MIX:
        return {"model": names[i % len(names)]}
    if route == PEER:
        return {"lora": _lora_list(len(names), i % len(names))}
    return {}


def texts(url: str, model: str, bodies: list[dict], streams: int, timeout: float = 900.0) -> list[str | None]:
    """The text of each unstreamed `/v1/completions` request (`bodies` complete but for `model`, which a body's
    own wins over), `streams` at a time; None for a request that failed."""
    def one(body: dict) -> str | None:
        data = json.dumps({"model": model, **body}).encode()
        req = urllib.request.Request(f"{url.rstrip('/')}/v1/completions", data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())["choices"][0]["text"]
        except Exception as e:  # noqa: BLE001 - counted as a failed request
            print(f"bench serve lora: {url}: {type(e).__name__}: {e}", file=sys.stderr)
            return None

    with ThreadPoolExecutor(streams) as pool:
        return list(pool.map(one, bodies))


def equal_texts(ours: list[str | None], theirs: list[str | None]) -> dict:
    """How many answers are the same text on both servers (failed ones never are), and the first that is not."""
    same = [a is not None and a == b for a, b in zip(ours, theirs)]
    first = next((i for i, s in enumerate(same) if not s), None)
    return {"equal": sum(same), "of": len(same), "first_different": first}


def limits(comparison: list[dict], rows: list[dict]) -> list:
    from tools.load import limits as lim
    from tools.load.paired import medians

    ratio = next((c["ratio"] for c in comparison if c["metric"] == "tokens_per_s"), None)
    base, peer = (medians(rows, label, ("tokens_per_s",))["tokens_per_s"] for label in (BASE, PEER))
    return [lim.own_best("LoRA mix tokens/s vs llama.cpp's", ratio, base, peer,
                         "npuserve's base-only tokens/s (the same tokens, no adapter)", str(TARGET))]


def run(a: argparse.Namespace) -> int:
    from tools.bench.gguf import load_gguf
    from tools.load import llamacpp_server, local_front, paired, runner
    from tools.load.openai_load import probe
    from tools.load.report import publish, table
    from tools.load.workload import Request
    from workers.llamacpp.tokenizer import GgufTokenizer
    from workers.lora.maker import make_lora

    import signal

    from tools.bench.serve.peer import _interrupt

    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C: both servers stopped, files removed
    prog = "npuserve bench serve lora"
    pkg = load_gguf(a.package, prog)
    tok = GgufTokenizer(pkg.gguf_path)
    tmp = tempfile.mkdtemp(prefix="npl-lora-gguf-", dir="/tmp")
    names = [f"lora{i}" for i in range(a.adapters)]
    peer = None
    try:
        paths = [make_lora(pkg.path, os.path.join(tmp, n), rank=a.rank, seed=i, strength=STRENGTH)
                 for i, n in enumerate(names)]
        ctx = a.prompt_tokens + a.max_tokens + 16
        settings = [f"model.package=\"{pkg.path}\"", f"board.threads_per_chip={a.threads}",
                    "executor.max_inflight=1", "admission.deadline_default_ms=3600000",
                    f"lora.max_loaded_per_chip={max(8, a.adapters)}"]
        extra = [w for n, p in zip(names, paths) for w in ("--lora", f"{n}={p}")]
        with local_front.daemon_and_front("bench serve lora", backend="llamacpp", chips=1, settings=settings,
                                          prefix="npl-", daemon_extra=extra) as (_d, front, _model):
            # a full-size sliding-window cache, as the llamacpp backend keeps it (and the reference tests run
            # llama.cpp): with its smaller default, llama.cpp's greedy texts under adapters left its own solo
            # runs' once its slots had run earlier requests (Gemma 3 270M)
            peer = llamacpp_server.start(pkg.gguf_path, threads=a.threads, parallel=a.streams, ctx_per_slot=ctx,
                                         swa_full=True, loras=[os.path.join(p, "adapter.gguf") for p in paths])
            urls = {MIX: front.url, PEER: peer.url, BASE: front.url}
            models = {k: probe(u)["id"] for k, u in urls.items()}

            def bodies(route: str, ps: list[list[int]]) -> list[dict]:
                return [{"prompt": p, "max_tokens": a.max_tokens, "temperature": 0.0, "ignore_eos": True,
                         **_route_fields(route, i, names)} for i, p in enumerate(ps)]

            # untimed: the texts of the mix on both servers (also every route's first requests)
            check = prompts(tok, a.requests, a.prompt_tokens, salt=10_000)
            answers = {k: texts(urls[k], models[k], bodies(k, check), a.streams) for k in (MIX, PEER, BASE)}
            agree = equal_texts(answers[MIX], answers[PEER])
            agree["differ_from_base"] = sum(x is not None and x != y for x, y in zip(answers[MIX], answers[BASE]))

            def requests(rnd: int) -> list[Request]:
                return [Request(i, p, a.max_tokens, seed=i, extra={"temperature": 0.0})
                        for i, p in enumerate(prompts(tok, a.requests, a.prompt_tokens, salt=rnd))]

            def route(name: str):
                def go(reqs: list[Request]):
                    mine = [replace(r, extra={**r.extra, **_route_fields(name, r.index, names)}) for r in reqs]
                    return runner.run(None, mine, concurrency=a.streams, clients=1, openai=urls[name],
                                      model=models[name])
                return go

            def on_row(row: dict) -> None:
                if not a.json:
                    print(f"round {row['round']}: {row['label']} {row['tokens_per_s']:.1f} tok/s", file=sys.stderr)

            rows = paired.run_rounds({k: route(k) for k in (MIX, PEER, BASE)}, requests, a.rounds,
                                     extra={"streams": a.streams, "threads": a.threads}, on_row=on_row)
    finally:
        if peer is not None:
            peer.stop()
        tok.close()
        shutil.rmtree(tmp, ignore_errors=True)
    comparison = paired.compare(rows, MIX, PEER, [TARGET], metrics=METRICS)
    comparison += paired.compare(rows, MIX, BASE, [], metrics=METRICS[:1])
    met = [c["met"] for c in comparison if "met" in c]
    summary = {"bench": "lora", "backend": "llamacpp", "package": pkg.name, "adapters": a.adapters, "rank": a.rank,
               "streams": a.streams, "threads": a.threads, "requests": a.requests, "max_tokens": a.max_tokens,
               "texts": agree, "comparison": comparison, "targets_met": all(met) if met else None}

    def text() -> str:
        diff = "" if agree["first_different"] is None else f" (first different: request {agree['first_different']})"
        return "\n".join([
            f"bench serve lora --backend llamacpp: {pkg.name}, {a.adapters} LoRA adapters (rank {a.rank}) in a uniform "
            f"mix, {a.streams} streams, prompt <= {a.prompt_tokens}, output {a.max_tokens}, greedy, ignore_eos, "
            f"{a.threads} thread(s) each, {a.rounds} rounds; npuserve = daemon + HTTP front (model = adapter), "
            f"llama.cpp = its own server (--lora, the request's `lora` list)",
            table(rows), "(latencies in ms; npuserve's mix against llama.cpp's and its own base on the medians)",
            paired.format_comparison(comparison),
            f"  texts of the mix: {agree['equal']} of {agree['of']} equal on both servers{diff}; "
            f"{agree['differ_from_base']} of {agree['of']} differ from the base model's (the adapters apply)"])

    status = publish("bench-lora", a.json, [*(("row", r) for r in rows), ("summary", summary)], text, rows,
                     limits=limits(comparison, rows))
    failed = sum(x is None for k in answers for x in answers[k])
    if failed:
        print(f"bench-lora: {failed} requests of the text check failed", file=sys.stderr)
    return 1 if failed else status
