"""`npuserve bench serve`: the load generator -- closed or open loop, sweeps, SLO goodput, the Pareto frontier.

Against `--endpoint` (a daemon or a balancer), `--openai URL` (any
OpenAI-compatible server, over HTTP) or a daemon it starts itself
(`--backend`, `--chips`). With `--sweep` it runs one point per concurrency cap
(or arrival rate) and marks the throughput / TTFT-P99 Pareto frontier; with
`--variant NAME:KEY=VALUE,...` it starts one daemon per variant (e.g. static
against continuous batching) and runs the same sweep on each, side by side.
For the `sim` backend every closed-loop point also gets the in-process
simulator's prediction for the same requests. With `--scenario NAME` it runs
one of the head-to-head scenarios instead (`tools/bench/serve/scenario.py`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from tools.bench.options import add
from tools.load.progress import Progress
from tools.load.report import Slo

# per backend: (requests per concurrency slot, prompt, output) when not given
DEFAULTS = {
    "stub": (8, "normal:64,200", "normal:256,50"),
    "sim": (4, "normal:128,200", "normal:128,50"),
    "ref": (2, "normal:32,200", "normal:32,50"),
    "ctypes": (2, "normal:32,200", "normal:32,50"),
}


@dataclass
class Variant:
    name: str
    settings: list[str] = field(default_factory=list)


def _variant(text: str) -> Variant:
    name, _, rest = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE]")
    sets = [kv.strip() for kv in rest.split(",") if kv.strip()]
    if any("=" not in kv for kv in sets):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: settings are KEY=VALUE")
    return Variant(name, sets)


def _sweep(text: str) -> tuple[str, list[float]]:
    kind, sep, vals = text.partition("=")
    if not sep:
        kind, vals = "concurrency", text
    if kind not in ("concurrency", "rate"):
        raise argparse.ArgumentTypeError(f"--sweep {text!r}: sweep concurrency (8,16,32) or rate=1,2,4")
    try:
        nums = [float(v) for v in vals.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sweep {text!r}: values must be numbers") from None
    if not nums or min(nums) <= 0:
        raise argparse.ArgumentTypeError(f"--sweep {text!r}: values must be positive")
    return kind, nums


def _slo(text: str) -> Slo:
    try:
        return Slo.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser(prog: str = "npuserve bench serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("target")
    g.add_argument("--endpoint", help="drive this daemon or balancer instead of starting a daemon")
    g.add_argument("--openai", metavar="URL",
                   help="drive this OpenAI-compatible server over HTTP (streamed /v1/completions), e.g. "
                        "http://127.0.0.1:8000: npuserve's front, llama.cpp's server, a vLLM")
    g.add_argument("--api-key", help="with --openai: sent as `Authorization: Bearer KEY`")
    g.add_argument("--model", help="with --openai: the `model` of each request (default: the first of /v1/models)")
    g.add_argument("--backend", choices=tuple(DEFAULTS), default="stub", help="backend of the daemon it starts")
    g.add_argument("--chips", type=int, default=2)
    g.add_argument("--max-inflight", type=int, default=2,
                   help="executor.max_inflight of the daemon (default 2: ping/pong hides the host round trip)")
    add(g, "set", "backend-option")
    g.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the daemon it starts, e.g. --daemon-arg=--trace=/tmp/t.json")
    g.add_argument("--variant", action="append", type=_variant, default=[], metavar="NAME:KEY=VALUE,...",
                   help="one daemon per variant with these extra settings, same workload (repeatable)")
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", type=int, default=64, help="closed loop: requests outstanding at once")
    g.add_argument("--rate", type=float, help="open loop: Poisson arrivals at this many requests/s")
    g.add_argument("--sweep", type=_sweep, help="caps 8,16,32 (closed loop) or rate=1,2,4 (open loop)")
    g.add_argument("--requests", type=int, help="requests per point (default: a few per concurrency slot)")
    g.add_argument("--per-slot", type=int, help="requests per concurrency slot when --requests is not given")
    g.add_argument("--prompt", help="prompt lengths: fixed:N | uniform:LO,HI | normal:MEAN,SD | heavy:MEDIAN,SIGMA")
    g.add_argument("--output", help="output lengths, same forms (heavy = log-normal, heavy-tailed)")
    g.add_argument("--text", action="store_true",
                   help="send prompts as `text` (printable ASCII) instead of token ids; needs a daemon with text")
    g.add_argument("--prefixes", type=int, default=0, help="shared-prefix mode: N system prompts ...")
    g.add_argument("--prefix-len", type=int, default=0, help="... of this many tokens, shared by the requests")
    g.add_argument("--tenants", help="NAME:WEIGHT,... requests split between tenants by weight")
    add(g, clients=2, seed=42)
    g.add_argument("--no-predict", action="store_true", help="skip the simulator's prediction (sim backend)")
    g = p.add_argument_group("scenario (tools/load/scenarios.py; docs/benchmarks.md, \"Scenarios\")")
    g.add_argument("--scenario", metavar="NAME",
                   help="run a head-to-head scenario instead of a sweep: long-prompt, tenant-flood, burst, hangups "
                        "(multi-turn chat: --conversations)")
    g.add_argument("--scenario-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a scenario size (e.g. long_prompt=3000); the output lists them all")
    g.add_argument("--quick", action="store_true", help="the scenario's short sizes (a plumbing check)")
    add(g, rounds=1, helps={"rounds": "scenario runs, one after another"})
    g.add_argument("--records", metavar="FILE.jsonl", help="with --scenario: every request's record, to recompute from")
    g = p.add_argument_group("output")
    g.add_argument("--slo", type=_slo, help="e.g. ttft=500ms,tpot=25ms: report goodput of requests meeting it")
    add(g, "json", "plot", "no-progress", helps={"plot": "draw the throughput / TTFT-P99 plot (needs matplotlib)"})
    from tools.bench.serve.conversations import add_arguments

    add_arguments(p)
    return p


def parse_args(argv: list[str], prog: str = "npuserve bench serve") -> argparse.Namespace:
    p = build_parser(prog)
    a = p.parse_args(argv)
    if a.chips < 1 or a.concurrency < 1 or (a.rate is not None and a.rate <= 0) or a.clients < 1:
        p.error("--chips, --concurrency, --clients and --rate must be positive")
    if (a.prefixes > 0) != (a.prefix_len > 0):
        p.error("shared-prefix mode needs both --prefixes N and --prefix-len L")
    if (a.endpoint or a.openai) and a.variant:
        p.error("--variant starts its own daemons; it cannot be combined with --endpoint or --openai")
    if a.endpoint and a.openai:
        p.error("--endpoint (ZeroMQ) and --openai (HTTP) name two targets; give one")
    if (a.api_key or a.model) and not a.openai:
        p.error("--api-key and --model go with --openai")
    if a.scenario:
        from tools.load import scenarios

        if a.variant or a.sweep or a.rate:
            p.error("--scenario makes its own requests: no --variant, --sweep or --rate with it")
        if a.rounds < 1:
            p.error("--rounds must be positive")
        try:
            s = scenarios.get(a.scenario)
            from tools.bench.serve.scenario import options_of

            options_of(a.scenario_option, s, a.quick)
        except ValueError as e:
            p.error(str(e))
    elif a.scenario_option or a.quick or a.records:
        p.error("--scenario-option, --quick and --records go with --scenario")
    from tools.load.workload import LengthDist, parse_tenants

    per_slot, prompt, output = DEFAULTS[a.backend]
    a.per_slot = a.per_slot or per_slot
    try:
        a.prompt_dist = LengthDist.parse(a.prompt or prompt)
        a.output_dist = LengthDist.parse(a.output or output)
        a.tenant_list = parse_tenants(a.tenants)
    except ValueError as e:
        p.error(str(e))
    if a.plot:
        from tools.load.plot import require_matplotlib

        require_matplotlib()
    return a


# ---------------------------------------------------------------- running


def points(a: argparse.Namespace) -> list[dict]:
    """The sweep points: {"concurrency": c} (closed loop) or {"rate": r} (open loop)."""
    if a.sweep:
        kind, vals = a.sweep
        return [{"concurrency": int(v)} if kind == "concurrency" else {"rate": v} for v in vals]
    return [{"rate": a.rate}] if a.rate else [{"concurrency": a.concurrency}]


def point_requests(a: argparse.Namespace, pt: dict) -> int:
    if a.requests:
        return a.requests
    if pt.get("concurrency"):
        return a.per_slot * pt["concurrency"]
    return max(16, int(pt["rate"] * 20))  # open loop: ~20 s of arrivals


def workload(a: argparse.Namespace, pt: dict, i: int, model: dict):
    from tools.load.workload import WorkloadSpec, build

    spec = WorkloadSpec(point_requests(a, pt), a.prompt_dist, a.output_dist, vocab=min(model["vocab_size"], 256),
                        max_seq=model["max_seq"], text=a.text, prefixes=a.prefixes, prefix_len=a.prefix_len,
                        tenants=a.tenant_list, rate=pt.get("rate"), seed=a.seed + i)
    return build(spec)


def predict(a: argparse.Namespace, settings: list[str], pt: dict, reqs, model: dict):
    """The simulator's run of the same requests and scheduler settings (sim backend, closed loop)."""
    if a.backend != "sim" or a.endpoint or a.openai or a.no_predict or not pt.get("concurrency"):
        return None
    from engine.config import load_config
    from engine.core.scheduler_config import scheduler_config_from
    from engine.flag_pairs import parse_pairs
    from engine.sim import SimRequest, simulate
    from workers.backends.sim_latency import LatencyModel

    cfg = load_config(None, {"board.backend": "sim", **parse_pairs(settings, "--set")})
    opts = parse_pairs(a.backend_option, "--backend-option")
    lat = LatencyModel(**{k: float(v) for k, v in opts.items() if k in LatencyModel.__dataclass_fields__})
    sim_reqs = [SimRequest(r.index, r.prompt, r.max_tokens) for r in reqs]
    return simulate("continuous", pt["concurrency"], sim_reqs, chips=a.chips, latency=lat,
                    profiles=tuple(model["profiles"]), max_seq=model["max_seq"],
                    num_blocks=cfg.kv.num_blocks or 4096, block_size=cfg.kv.block_size,
                    config=scheduler_config_from(cfg))


def run_variant(a: argparse.Namespace, v: Variant, progress: Progress) -> list[dict]:
    from tools.bench.serve.server import open_server
    from tools.load.chip_runs import daemon_run, sim_run
    from tools.load.report import summarize

    settings = [f"executor.max_inflight={a.max_inflight}", *a.set, *v.settings]
    rows = []
    external = a.endpoint or a.openai
    with open_server(a, settings, "npb-") as server:
        for i, pt in enumerate(points(a)):
            reqs = workload(a, pt, i, server.model)
            label = v.name
            progress.point(f"{label} " + (f"c={pt['concurrency']}" if pt.get("concurrency") else f"rate={pt['rate']}"))
            before = _stats_or_none(server.endpoint)
            recs = server.send(reqs, concurrency=pt.get("concurrency"), clients=a.clients, on_record=progress.record)
            after = _stats_or_none(server.endpoint)
            row = {"label": label, "backend": a.backend if not external else None, "chips": a.chips,
                   "concurrency": pt.get("concurrency"), "rate": pt.get("rate"), **summarize(recs, a.slo),
                   "prompt": str(a.prompt_dist), "output": str(a.output_dist), "settings": settings}
            try:  # a board daemon's stats; a balancer's may not have the per-chip counters
                row["daemon_run"] = daemon_run(before, after, row["seconds"])
            except (KeyError, TypeError):
                row["daemon_run"] = None
            sim = predict(a, settings, pt, reqs, server.model)
            row["predicted_tokens_per_s"] = None if sim is None else round(sim.throughput_tok_s, 1)
            row["predicted_ttft_p99_ms"] = None if sim is None else round(sim.ttft_p99_ms, 1)
            row["predicted_run"] = None if sim is None else sim_run(sim)
            rows.append(row)
            server.failed = server.failed or bool(row["errors"])
    return rows


def _stats_or_none(endpoint: str | None) -> dict | None:
    from engine.errors import ClientError
    from tools.load import local_daemon

    if endpoint is None:  # an HTTP server: no daemon stats
        return None
    try:
        return local_daemon.stats(endpoint)
    except ClientError:
        return None


def predicted_rows(rows: list[dict]) -> list[dict]:
    """The simulator's points as rows of their own (label `predicted <variant>`), for the frontier and plot."""
    out = []
    for r in rows:
        if r.get("predicted_tokens_per_s") is not None:
            out.append({"label": f"predicted {r['label']}", "concurrency": r["concurrency"], "rate": None,
                        "tokens_per_s": r["predicted_tokens_per_s"], "ttft_p99_ms": r["predicted_ttft_p99_ms"]})
    return out


def mark_frontier(rows: list[dict]) -> None:
    from tools.load.report import pareto

    for label in dict.fromkeys(r["label"] for r in rows):
        front = {id(r) for r in pareto([r for r in rows if r["label"] == label])}
        for r in rows:
            if r["label"] == label:
                r["pareto"] = id(r) in front


def compare(rows: list[dict]) -> list[dict]:
    """Throughput of each variant against the last one at the same TTFT-P99 budget.

    For every point of the baseline (the last variant, e.g. static batching),
    the budget is that point's TTFT P99; each variant's best measured
    throughput within the budget is compared with the baseline's.
    """
    labels = [lab for lab in dict.fromkeys(r["label"] for r in rows) if not lab.startswith("predicted")]
    if len(labels) < 2:
        return []
    base = labels[-1]
    out = []
    for b in sorted((r for r in rows if r["label"] == base and r.get("ttft_p99_ms")), key=lambda r: r["ttft_p99_ms"]):
        budget = b["ttft_p99_ms"]
        base_best = max(r["tokens_per_s"] for r in rows if r["label"] == base and r.get("ttft_p99_ms")
                        and r["ttft_p99_ms"] <= budget)
        for lab in labels[:-1]:
            within = [r for r in rows if r["label"] == lab and r.get("ttft_p99_ms") and r["ttft_p99_ms"] <= budget]
            best = max(within, key=lambda r: r["tokens_per_s"]) if within else None
            out.append({"variant": lab, "baseline": base, "ttft_p99_budget_ms": budget,
                        "baseline_tokens_per_s": base_best,
                        "tokens_per_s": None if best is None else best["tokens_per_s"],
                        "at_concurrency": None if best is None else best["concurrency"],
                        "ratio": None if best is None else round(best["tokens_per_s"] / max(base_best, 1e-9), 2)})
    return out


def run(a: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    variants = a.variant or [Variant("openai" if a.openai else a.backend if not a.endpoint else "endpoint")]
    total = sum(point_requests(a, pt) for pt in points(a)) * len(variants)
    progress = Progress(total, not a.no_progress)
    rows: list[dict] = []
    try:
        for v in variants:
            rows += run_variant(a, v, progress)
    finally:
        progress.close()
    rows += predicted_rows(rows)
    mark_frontier(rows)
    return rows, compare(rows)


def format_text(rows: list[dict], comparison: list[dict]) -> str:
    from tools.load.report import table

    out = [table(rows)]
    out.append("(latencies in ms; frontier * = on the throughput / TTFT-P99 Pareto frontier of its run label)")
    for r in rows:
        ran, pred = r.get("daemon_run"), r.get("predicted_run")
        if r.get("errors"):
            out.append(f"  {r['label']}: {r['errors']} requests failed, by code {r['error_codes']}"
                       + (" (400 with --text: this daemon does not accept `text` prompts)" if "400" in r["error_codes"]
                          and any("--text" in x for x in sys.argv) else ""))
        if r.get("predicted_tokens_per_s"):
            delivered = 100 * r["tokens_per_s"] / r["predicted_tokens_per_s"]
            out.append(f"  {r['label']} c={r['concurrency']}: delivered {delivered:.1f} % of predicted; device busy "
                       f"{ran['device_busy']} (simulator {pred['device_busy']})")
        if r.get("tenants"):
            parts = ", ".join(f"{t}: {s['requests']} req {s['tokens_per_s']} tok/s TTFT p99 {s['ttft_p99_ms']}"
                              for t, s in r["tenants"].items())
            out.append(f"  {r['label']} tenants: {parts}")
    for c in comparison:
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}x"
        out.append(f"  at TTFT P99 <= {c['ttft_p99_budget_ms']:,.0f} ms: {c['variant']} {c['tokens_per_s']} tok/s vs "
                   f"{c['baseline']} {c['baseline_tokens_per_s']} tok/s = {ratio}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.conversations:
        from tools.bench.serve.conversations import run as run_conversations

        return run_conversations(a)
    if a.scenario:
        from tools.bench.serve.scenario import bench_main

        return bench_main(a)
    from tools.load.report import publish

    rows, comparison = run(a)
    best = max((c["ratio"] for c in comparison if c["ratio"] is not None), default=None)
    summary = {"points": len(rows), "errors": sum(r.get("errors", 0) for r in rows), "comparison": comparison,
               "best_ratio": best}
    code = publish("bench", a.json, [*(("row", r) for r in rows), ("summary", summary)],
                   lambda: format_text(rows, comparison), rows)
    if a.plot:
        from tools.load.plot import pareto_png

        title = (f"{a.openai or a.endpoint or a.backend}: {a.chips} chip(s), prompt {a.prompt_dist}, "
                 f"output {a.output_dist}")
        pareto_png(rows, a.plot, title)
        print(f"bench: plot written to {a.plot}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
