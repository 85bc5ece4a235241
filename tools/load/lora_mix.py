"""`npuserve bench serve lora`: tokens/s of a uniform mix of LoRA adapters against base-only requests, paired.

One board (`ref` by default, or `sim`: the same package and adapters, the
sim's modelled 7B step time and adapter costs instead of the NumPy
transformer), a generated base package and N adapters from `make-lora`, all
in device slots; each round runs the same requests twice, once on the
base model and once spread uniformly over the adapters, in alternating order,
at a fixed number of concurrent streams. The row is the median ratio of
tokens/s (mix / base) over the rounds; the target is 0.8 (docs/lora.md).
Figures are for a quiet machine: on a loaded one they mean little.

`--backend llamacpp`: the Gemma row instead, a mix of GGUF adapters on
npuserve against llama.cpp's own server (`tools.bench.serve.lora_peer`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import orjson

from tools.bench.options import add

TARGET = 0.8


def _run(endpoint: str, prompts: list[list[int]], adapters: list[str | None], streams: int, max_tokens: int) -> float:
    """Tokens per second of the requests (prompt i under adapters[i]) over `streams` client threads."""
    from engine.client import Client

    tokens = [0] * streams
    errors: list[str] = []

    def client(k: int) -> None:
        try:
            with Client(endpoint, timeout=600) as c:
                for i in range(k, len(prompts), streams):
                    kw = {} if adapters[i] is None else {"adapter": adapters[i]}
                    tokens[k] += len(c.generate(prompts[i], max_tokens=max_tokens, ignore_eos=True, **kw).tokens)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(k,)) for k in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"npuserve bench serve lora: {errors[0]}")
    return sum(tokens) / (time.perf_counter() - t0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="npuserve bench serve lora", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("ref", "sim", "llamacpp"), default="ref",
                    help="ref: the NumPy model; sim: the modelled NPU's step and adapter costs (both: a generated "
                         "model, mix against base only); llamacpp: a GGUF model (--package), mix on npuserve "
                         "against the mix on llama.cpp's server")
    ap.add_argument("--adapters", type=int, default=None, help="adapters in the mix (default: 8; llamacpp 4)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64, help="requests per route per round")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    llama = ap.add_argument_group("--backend llamacpp")
    add(llama, "package", "threads", helps={"threads": "CPU threads of each engine (default: the machine's cores)"})
    llama.add_argument("--prompt-tokens", type=int, help="prompt length at most (default 64)")
    a = ap.parse_args(argv)
    if a.adapters is None:
        a.adapters = 4 if a.backend == "llamacpp" else 8
    if a.backend != "llamacpp" and (a.package, a.threads, a.prompt_tokens) != (None, None, None):
        ap.error("--package, --threads and --prompt-tokens are for --backend llamacpp")
    if a.backend == "llamacpp":
        from workers.backends.llamacpp import default_threads

        a.threads = default_threads() if a.threads is None else a.threads
        a.prompt_tokens = 64 if a.prompt_tokens is None else a.prompt_tokens
        if min(a.adapters, a.rank, a.streams, a.requests, a.max_tokens, a.rounds, a.threads, a.prompt_tokens) < 1:
            ap.error("--adapters, --rank, --streams, --requests, --max-tokens, --rounds, --threads and "
                     "--prompt-tokens must be positive")
        from tools.bench.serve.lora_peer import run

        return run(a)
    import numpy as np

    from tools.load.local_daemon import start, wait_healthy
    from workers.lora.maker import make_lora
    from workers.model_maker import make_model

    tmp = tempfile.mkdtemp(prefix="npl-lora-", dir="/tmp")
    daemon = None
    try:
        # the sim's tokens are not the model's: its package carries no golden cases to check them against
        base = make_model(os.path.join(tmp, "base"), golden_cases=1 if a.backend == "ref" else 0)
        names = [f"lora{i}" for i in range(a.adapters)]
        extra = ["--package", base]
        for i, n in enumerate(names):
            extra += ["--lora", f"{n}={make_lora(base, os.path.join(tmp, n), rank=a.rank, seed=i)}"]
        daemon = start(backend=a.backend, chips=1, settings=[f"lora.max_loaded_per_chip={max(1, a.adapters)}"],
                       extra=extra)
        wait_healthy(daemon.endpoint, daemon)
        rng = np.random.default_rng(0)
        rows = []
        for r in range(a.rounds):
            prompts = [[256] + rng.integers(0, 256, int(rng.integers(8, 64))).tolist() for _ in range(a.requests)]
            routes = {"base": [None] * a.requests, "mix": [names[i % len(names)] for i in range(a.requests)]}
            order = ["base", "mix"] if r % 2 == 0 else ["mix", "base"]
            row = {k: _run(daemon.endpoint, prompts, routes[k], a.streams, a.max_tokens) for k in order}
            row["ratio"] = row["mix"] / row["base"]
            rows.append(row)
            if not a.json:
                print(f"round {r + 1}: base {row['base']:.1f} tok/s, mix of {len(names)} adapters "
                      f"{row['mix']:.1f} tok/s, ratio {row['ratio']:.3f}", file=sys.stderr)
        ratio = statistics.median(x["ratio"] for x in rows)
        summary = {"bench": "lora", "backend": a.backend, "adapters": a.adapters, "streams": a.streams,
                   "rounds": rows, "ratio_median": ratio, "target": TARGET, "met": ratio >= TARGET}
        if a.json:
            print(orjson.dumps(summary).decode())
        else:
            print(f"{a.backend}, {a.adapters} adapters uniform vs base only, {a.streams} streams: "
                  f"{ratio:.3f}x tokens/s (target >= {TARGET}) {'met' if ratio >= TARGET else 'NOT met'}")
        return 0
    finally:
        if daemon is not None:
            daemon.stop()
            daemon.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
