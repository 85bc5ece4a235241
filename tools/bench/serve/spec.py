"""`npuserve bench serve spec`: speculative (n-gram) decoding against plain decoding, and against llama.cpp's server.

One npuserve daemon (llamacpp backend, `speculative.method = "ngram"`) serves
both npuserve sides; each request says `speculative: "off"` or `"ngram"`, so
the two sides share the process, the model and the warm caches, and run the
same requests back to back, the order flipping every round (paired ratios).
llama.cpp's own server engine (xllamacpp `Server`) runs the same GGUF,
threads and prompts with its n-gram speculation (`ngram-simple`, lookup
n-gram and draft length matched to ours) when `--peer` is given.

Workloads: `copy` (edit or repeat a given text: the output copies the
prompt, where prompt lookup drafts well) and `free` (stories: little to copy,
where adaptive k must turn drafting down). Greedy, `ignore_eos`, so both
sides produce the same tokens. The prefix cache is off: the side that runs second would
otherwise find its prompts cached, and llama.cpp's fresh server never does.
Every npuserve speculating row carries the
acceptance rate and tokens per verification step read from the daemon's
stats around the run.
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import asdict, dataclass

from tools.bench.options import THREADS, add
from tools.json_lines import emit
from tools.load import chip_runs, local_daemon, paired, runner
from tools.load import limits as lim
from tools.load.report import publish, summarize, table
from tools.load.workload import Request

SPEC, PLAIN, PEER = "npuserve-ngram", "npuserve-plain", "llama.cpp-ngram"
TARGETS = {  # (workload, streams, subject, baseline): ratio of tokens_per_s at least
    ("copy", 1, SPEC, PLAIN): 1.5,
    ("copy", 1, SPEC, PEER): 1.0,
    ("free", 1, SPEC, PLAIN): 0.97,
    ("copy", 16, SPEC, PLAIN): 0.97,
    ("free", 16, SPEC, PLAIN): 0.97,
}
COLUMNS = [("engine", "engine"), ("workload", "workload"), ("streams", "streams"), ("round", "round"),
           ("tokens_per_s", "tok/s"), ("tpot_p50_ms", "tpot p50"), ("ttft_p50_ms", "ttft p50"),
           ("acceptance_rate", "accept"), ("tokens_per_step", "tok/step")]

_SOURCE = ("def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
           "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
           "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
           "    return out\n")
_TEXT = ("The river town grew slowly. Its market opened every morning at six, its bridge was rebuilt twice, "
         "and its library kept the letters of every mayor since the first one. ")
_COPY = (
    "Rename the function merge_sorted to merge_lists and repeat the whole code unchanged otherwise.\n\n{src}\n"
    "Here is the code with the function renamed:\n\ndef merge_lists(a, b):\n",
    "Copy the following paragraph exactly, word for word.\n\n{text}\n\nCopy:\n\n",
)
_FREE = ("Write a short story about a lighthouse keeper who finds a strange map.",
         "Tell me a story about a robot learning to paint.",
         "Write a fable about a fox, a crow and a very old tree.",
         "Describe a journey across a desert on a camel, as a story.")


@dataclass
class Row:
    engine: str
    workload: str
    streams: int
    round: int
    tokens_per_s: float
    tpot_p50_ms: float
    ttft_p50_ms: float
    acceptance_rate: float | None = None
    tokens_per_step: float | None = None
    drafted: int | None = None
    accepted: int | None = None
    # npuserve: the chip's decode jobs, device seconds and generated tokens over the run (the speculation model)
    decode_jobs: int | None = None
    device_s: float | None = None
    generated: int | None = None


def make_prompts(tok, workload: str, n: int) -> list[list[int]]:
    """n prompts of the workload (chat-less completions, BOS as the model wants)."""
    out = []
    for i in range(n):
        if workload == "copy":
            t = _COPY[i % 2].format(src=_SOURCE.replace("out", f"out{i}"), text=_TEXT * (1 + i % 2))
        else:
            t = _FREE[i % len(_FREE)] + f" (story {i})\n\n"
        out.append(tok.encode(t))
    return out


def spec_delta(before: dict, after: dict) -> dict:
    """The speculative counters of one run: after - before (stats()["scheduler"]["speculative"])."""
    d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                           "num_emitted_tokens")}
    d["acceptance_rate"] = round(d["num_accepted_tokens"] / d["num_draft_tokens"], 3) if d["num_draft_tokens"] else None
    d["tokens_per_step"] = round(d["num_emitted_tokens"] / d["num_drafts"], 3) if d["num_drafts"] else None
    return d


def _row(engine: str, workload: str, c: int, rnd: int, records, spec: dict | None = None) -> Row:
    s = summarize(records)
    row = Row(engine, workload, c, rnd, s["tokens_per_s"], s["tpot_p50_ms"] or 0.0, s["ttft_p50_ms"] or 0.0)
    if spec is not None:
        row.acceptance_rate, row.tokens_per_step = spec["acceptance_rate"], spec["tokens_per_step"]
        row.drafted, row.accepted = spec["num_draft_tokens"], spec["num_accepted_tokens"]
    return row


def run_npuserve(endpoint: str, prompts, out_tokens: int, c: int, workload: str, rnd: int, spec: bool) -> Row:
    from engine.client import Client

    reqs = [Request(i, p, out_tokens, seed=i, extra={"temperature": 0.0, "speculative": "ngram" if spec else "off"})
            for i, p in enumerate(prompts)]
    with Client(endpoint, timeout=60) as cl:
        before = cl.stats()
    records = runner.run_here(endpoint, reqs, concurrency=c, timeout=900)
    with Client(endpoint, timeout=60) as cl:
        after = cl.stats()
    ran = chip_runs.daemon_run(before, after, 1.0)
    spec_d = spec_delta(before["scheduler"]["speculative"], after["scheduler"]["speculative"]) if spec else None
    row = _row(SPEC if spec else PLAIN, workload, c, rnd, records, spec_d)
    row.decode_jobs, row.device_s = decode_job_count(ran), round(sum(ran["device_s"]), 4)
    row.generated = sum(r.tokens for r in records if r.error is None)
    return row


def decode_job_count(ran: dict) -> int:
    """The jobs that stepped decode lanes in a run (`chip_runs.daemon_run`): with mixed batches (llamacpp)
    decode lanes step, and drafts are verified, in mixed jobs, so those count beside plain decode jobs."""
    return ran["decode_jobs"] + ran["mixed_jobs"]


def limits(rows: list[Row], rs: list[dict]) -> list:
    """Speculation's tokens/s over plain decoding beside its expectation, tokens per step / cost per step
    (lim.speculation), both from the run's own jobs summed over rounds: tokens per step = (tokens per decode
    job, speculating) / (tokens per decode job, plain); cost per step = (device seconds per decode job,
    speculating) / (the same, plain). Device seconds include the prompts' (the same on both sides)."""
    out = []
    for x in rs:
        if x["baseline"] != PLAIN:
            continue
        key = (x["workload"], x["streams"])

        def per_job(engine: str, what: str) -> float | None:
            rr = [r for r in rows if (r.workload, r.streams) == key and r.engine == engine and r.decode_jobs]
            jobs = sum(r.decode_jobs for r in rr)
            return sum(getattr(r, what) or 0 for r in rr) / jobs if jobs else None

        tok_s, tok_p = per_job(SPEC, "generated"), per_job(PLAIN, "generated")
        dev_s, dev_p = per_job(SPEC, "device_s"), per_job(PLAIN, "device_s")
        yield_ = tok_s / tok_p if tok_s and tok_p else None
        cost = dev_s / dev_p if dev_s and dev_p else None
        peer = next((y["ratio"] for y in rs if (y["workload"], y["streams"]) == key and y["baseline"] == PEER), None)
        out.append(lim.speculation(f"{x['workload']} streams={x['streams']} n-gram / plain tok/s", x["ratio"],
                                   yield_, cost, "within 10 % of the bound, ahead of llama.cpp's n-gram",
                                   acceptance_rate=x["acceptance_rate"], vs_llama_cpp_ngram=peer))
    return out


def ngram_tune(n: int, m: int):
    """llama.cpp's server with n-gram speculation matched to ours: lookup n-gram n, drafts of up to m tokens."""
    def tune(p) -> None:
        import xllamacpp as xlc

        sp = p.speculative
        sp.types = [xlc.common_speculative_type.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
        sp.ngram_simple.size_n = n
        sp.ngram_simple.size_m = m
        sp.draft.n_max = m
        sp.draft.n_min = 0
    return tune


def ratios(rows: list[Row]) -> list[dict]:
    """tokens_per_s of subject over baseline per (workload, streams), with every round's own ratio and targets."""
    out = []
    for workload, c in sorted({(r.workload, r.streams) for r in rows}):
        runs = [{"label": r.engine, **asdict(r)} for r in rows if (r.workload, r.streams) == (workload, c)]
        labels = {r["label"] for r in runs}
        for base in (PLAIN, PEER):
            if not {SPEC, base} <= labels:
                continue
            s, b = paired.medians(runs, SPEC, ("tokens_per_s",)), paired.medians(runs, base, ("tokens_per_s",))
            if not b["tokens_per_s"]:
                continue
            ratio = round(s["tokens_per_s"] / b["tokens_per_s"], 3)
            acc = [r["acceptance_rate"] for r in runs if r["label"] == SPEC and r["acceptance_rate"] is not None]
            row = {"workload": workload, "streams": c, "subject": SPEC, "baseline": base, "metric": "tokens_per_s",
                   "ratio": ratio, "round_ratios": paired.round_values(runs, SPEC, base, "tokens_per_s", False),
                   "acceptance_rate": round(sum(acc) / len(acc), 3) if acc else None}
            bound = TARGETS.get((workload, c, SPEC, base))
            if bound is not None:
                row.update(target=f">= {bound}", met=ratio >= bound, distance=round(ratio - bound, 3),
                           within_spread=paired.bound_within(row["round_ratios"], bound))
            out.append(row)
    return out


def format_report(rows: list[Row], rs: list[dict]) -> str:
    lines = [table([asdict(r) for r in rows], COLUMNS), "",
             "tokens/s, n-gram speculation over the baseline (median over rounds; rounds' own ratios in brackets):"]
    for x in rs:
        spread = f" [{min(x['round_ratios']):.3f}-{max(x['round_ratios']):.3f}]" if len(x["round_ratios"]) > 1 else ""
        verdict = ""
        if "target" in x:
            verdict = f"  target {x['target']}: {'met' if x['met'] else 'MISSED by ' + str(abs(x['distance']))}"
            if x["within_spread"]:
                verdict += " (the bound lies inside the rounds' spread)"
        acc = f"  acceptance {x['acceptance_rate']}" if x["acceptance_rate"] is not None else ""
        lines.append(f"  {x['workload']:<5} streams={x['streams']:<3} vs {x['baseline']:<16} {x['ratio']:.3f}"
                     f"{spread}{acc}{verdict}")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    from tools.bench.serve.peer import run_llamacpp_server

    signal.signal(signal.SIGTERM, _interrupt)
    ap = argparse.ArgumentParser(prog="npuserve bench serve spec", description=__doc__.split("\n\n")[0])
    add(ap, "package")
    ap.add_argument("--streams", type=_ints, default=[1, 4, 16])
    ap.add_argument("--workloads", default="copy,free")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--max-draft-tokens", type=int, default=4)
    add(ap, threads=THREADS, rounds=2)
    ap.add_argument("--peer", action="store_true", help="also llama.cpp's server with its n-gram speculation")
    add(ap, "set", "json", helps={"set": "npuserve config override"})
    a = ap.parse_args(argv)

    from tools.bench.gguf import load_gguf
    from workers.llamacpp.tokenizer import GgufTokenizer

    pkg = load_gguf(a.package, "npuserve bench serve spec")
    tok = GgufTokenizer(pkg.gguf_path)
    settings = [f"model.package=\"{pkg.path}\"", f"board.threads_per_chip={a.threads}", "executor.max_inflight=1",
                "admission.deadline_default_ms=3600000", "speculative.method=\"ngram\"", "kv.prefix_cache=false",
                f"speculative.max_draft_tokens={a.max_draft_tokens}", *a.set]
    d = local_daemon.start(backend="llamacpp", chips=1, settings=settings, prefix="nps-")
    rows: list[Row] = []
    try:
        local_daemon.wait_healthy(d.endpoint, d, timeout=300)

        def run(side: str, rnd: int, group: tuple[str, int]) -> Row:
            workload, c = group
            prompts = make_prompts(tok, workload, c * a.requests_per_stream)
            print(f"round {rnd + 1}/{a.rounds}: {side} {workload} streams={c} ...", file=sys.stderr, flush=True)
            if side == PEER:
                row = run_llamacpp_server(a, pkg.gguf_path, prompts, [], a.output_tokens, c, workload,
                                          rnd, tune=ngram_tune(3, a.max_draft_tokens), engine=PEER)
                row = Row(PEER, workload, c, rnd + 1, row.tokens_per_s, row.tpot_p50_ms, row.ttft_p50_ms)
            else:
                row = run_npuserve(d.endpoint, prompts, a.output_tokens, c, workload, rnd + 1, side == SPEC)
            if a.json:
                emit("row", asdict(row))
            return row

        # speculation first where round + streams is even
        rows = paired.alternate([SPEC, PLAIN] + ([PEER] if a.peer else []), a.rounds, run,
                                groups=[(w, c) for w in a.workloads.split(",") for c in a.streams],
                                flip=lambda rnd, group: (rnd + group[1]) % 2 == 1)
        from engine.client import Client

        with Client(d.endpoint, timeout=60) as cl:  # what the daemon measured a verification step to cost
            step_cost = cl.stats()["scheduler"]["speculative"].get("step_cost")
    except BaseException:
        print(f"npuserve daemon log (tail):\n{d.log_tail()}", file=sys.stderr)
        raise
    finally:
        d.stop(60)
        d.cleanup()
        tok.close()
    rs = ratios(rows)
    return publish("bench-spec", a.json, [*(("ratio", x) for x in rs), ("step_cost", step_cost or {})],
                   lambda: f"{pkg.name}, {a.threads} threads, output {a.output_tokens} tokens, greedy, ignore_eos, "
                           f"max {a.max_draft_tokens} drafts\n" + format_report(rows, rs) + "\n"
                           + format_step_cost(step_cost), limits=limits(rows, rs))


def format_step_cost(t: dict | None) -> str:
    """The daemon's measured verification cost (stats speculative.step_cost): plain steps at k drafts."""
    if not t:
        return "verification step cost: not reported"
    ks = ", ".join(f"k={k} {v:.2f}" for k, v in t["cost_in_steps"].items() if v is not None) or "none measured"
    return (f"verification step cost in plain steps ({t['lanes']} lane, plain step {t['plain_step_us']} us): {ks}; "
            f"slope {t['per_draft']} steps per draft (k is chosen from it)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
