"""`npuserve bench micro kv-layout`: what the shared KV cell pool costs a burst prefill, against a stream per slot.

Why it exists: bench-peer's TTFT P99 at 32 streams is at parity, and this
measures the one difference of layout in the prefill itself. npuserve's
`llamacpp` backend opens one context whose cells are one pool shared by
every sequence (`kv_unified`): a prefix copy then shares cells, which the
radix prefix cache needs. llama.cpp's own server gives each slot a stream
of n_ctx / n_parallel cells instead. In a shared pool each prompt token's
attention mask spans the occupied cells of every sequence (masked out when
they are another's); a stream per slot holds only its own.

In one process, the same prompt tokens as bench-peer's `plain` workload
(S streams x P tokens, the logits of each prompt's last token) go through
one `llama_decode` in contexts of each layout (`--instances` of each: two
identical contexts already differ by a few per cent, so the spread between
them is reported beside the layout ratio), the order flipping every
repetition. Rows `{layout, instance, rep, ms, tokens_per_s}`, then the
medians and the ratio per-sequence / shared. There is no target: the ratio
is the head start llama.cpp's server has on a burst prefill, which npuserve
makes up by running the burst as one job (see docs/models.md, "Measured").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from tools.bench.options import THREADS, add
from tools.load.paired import alternate
from tools.load.report import publish

LAYOUTS = ("shared", "per-sequence")


def burst(tok, streams: int, prompt_tokens: int):
    """bench-peer's `plain` prompts as one decode: (tokens, positions, sequence ids, want-logits flags)."""
    import numpy as np

    from tools.bench.serve.peer import make_prompts

    prompts, _ = make_prompts(tok, "plain", streams, prompt_tokens)
    tokens = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    pos = np.concatenate([np.arange(len(p), dtype=np.int32) for p in prompts])
    seq = np.concatenate([np.full(len(p), i, np.int32) for i, p in enumerate(prompts)])
    want = np.zeros(len(tokens), np.int8)
    want[np.cumsum([len(p) for p in prompts]) - 1] = 1
    return tokens, pos, seq, want


def open_context(gguf: str, layout: str, streams: int, tokens: int, longest: int, threads: int):
    """Both layouts get the same cells: a stream per sequence holds its longest prompt, rounded up to 256."""
    from workers.llamacpp.binding import LlamaModel

    per_seq = -(-longest // 256) * 256
    return LlamaModel(gguf, n_ctx=streams * per_seq, n_batch=tokens, n_ubatch=512, n_seq_max=streams,
                      n_threads=threads, per_sequence_kv=layout == "per-sequence")


def run(gguf: str, tok, streams: int, prompt_tokens: int, reps: int, threads: int, instances: int,
        progress) -> list[dict]:
    """Every repetition times every context once: layouts interleaved (shared 1, per-sequence 1, shared 2,
    ...), the order reversed every other repetition."""
    tokens, pos, seq, want = burst(tok, streams, prompt_tokens)
    longest = int(pos.max()) + 1
    order = [(layout, k + 1) for k in range(instances) for layout in LAYOUTS]
    models = {}
    rows = []
    try:
        for layout, k in order:
            models[layout, k] = open_context(gguf, layout, streams, len(tokens), longest, threads)
        for m in models.values():  # untimed: first touch of the weights and the graph
            m.decode_in_place(tokens[:8], pos[:8], seq[:8], want[:8])
            m.clear()

        def one(context: tuple[str, int], rep: int, _group) -> dict:
            layout, k = context
            m = models[context]
            m.clear()
            t = time.perf_counter()
            rc, _ = m.decode_in_place(tokens, pos, seq, want)
            dt = time.perf_counter() - t
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} in the {layout} layout")
            row = {"layout": layout, "instance": k, "rep": rep + 1, "streams": streams,
                   "prompt_tokens": prompt_tokens, "ms": round(1000 * dt, 1), "tokens_per_s": round(len(tokens) / dt, 1)}
            progress(row)
            return row

        rows = alternate(order, reps, one)
    finally:
        for m in models.values():
            m.close()
    return rows


def summarise(rows: list[dict]) -> dict:
    """Medians per layout (over all its instances) and per instance: a layout difference smaller than the
    spread between instances of one layout is not a layout difference."""
    med = {layout: statistics.median(r["ms"] for r in rows if r["layout"] == layout) for layout in LAYOUTS}
    contexts = dict.fromkeys((r["layout"], r["instance"]) for r in rows)
    per_instance = {f"{layout} {k}": statistics.median(r["ms"] for r in rows
                                                      if (r["layout"], r["instance"]) == (layout, k))
                    for layout, k in contexts}
    by_layout = {layout: [per_instance[f"{la} {k}"] for la, k in contexts if la == layout] for layout in LAYOUTS}
    spread = max(max(v) / min(v) for v in by_layout.values())
    return {"median_ms": med, "instance_median_ms": per_instance,
            "per_sequence_over_shared": round(med["per-sequence"] / med["shared"], 3),
            "instance_spread": round(spread, 3)}


def main(argv: list[str]) -> int:

    ap = argparse.ArgumentParser(prog="npuserve bench micro kv-layout", description=__doc__.split("\n\n")[0])
    add(ap, "package")
    ap.add_argument("--streams", type=int, default=32, help="prompts in the burst (bench-peer's concurrency)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=6, help="repetitions; each times every context, order flipping")
    ap.add_argument("--instances", type=int, default=2,
                    help="contexts of each layout (identical ones differ by a few per cent: the spread is shown)")
    add(ap, "json", threads=THREADS)
    a = ap.parse_args(argv)
    if min(a.streams, a.prompt_tokens, a.reps, a.threads, a.instances) < 1:
        ap.error("--streams, --prompt-tokens, --reps, --threads and --instances must be positive")

    from tools.bench.gguf import load_gguf
    from workers.llamacpp.tokenizer import GgufTokenizer

    pkg = load_gguf(a.package, "npuserve bench micro kv-layout")
    tok = GgufTokenizer(pkg.gguf_path)

    def progress(row: dict) -> None:
        print(f"rep {row['rep']}/{a.reps} {row['layout']} {row['instance']}: {row['ms']:,.0f} ms", file=sys.stderr,
              flush=True)

    try:
        rows = run(pkg.gguf_path, tok, a.streams, a.prompt_tokens, a.reps, a.threads, a.instances, progress)
    finally:
        tok.close()
    summary = summarise(rows)

    def text() -> str:
        med = summary["median_ms"]
        return "\n".join([
            f"one llama_decode of {a.streams} prompts x {a.prompt_tokens} tokens ({pkg.name}, {a.threads} threads), "
            f"{a.instances} context(s) of each layout, {a.reps} repetitions, order flipping",
            f"{'layout':<13} {'ctx':>3} {'rep':>3} {'ms':>9} {'tok/s':>9}",
            *(f"{r['layout']:<13} {r['instance']:>3} {r['rep']:>3} {r['ms']:>9,.1f} {r['tokens_per_s']:>9,.1f}"
              for r in rows),
            "medians by context: " + ", ".join(f"{k} {v:,.1f} ms" for k, v in summary["instance_median_ms"].items()),
            f"medians: shared {med['shared']:,.1f} ms, per-sequence {med['per-sequence']:,.1f} ms; "
            f"per-sequence / shared = {summary['per_sequence_over_shared']:.3f}; largest spread between contexts of "
            f"one layout {summary['instance_spread']:.3f}x (no target: the head start of llama.cpp server's layout "
            f"on a burst prefill, where it exceeds that spread)"])

    publish("bench-kv-layout", a.json, [*(("row", r) for r in rows), ("summary", {**summary, "target": None})], text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
