"""Running a scenario (`tools.load.scenarios`): `npuserve bench serve --scenario` and `bench serve http-peer --scenario`.

`npuserve bench --scenario NAME` runs it against one target (a daemon it
starts, `--endpoint`, or `--openai URL`) and reports the scenario's metrics
and its absolute targets; `bench-http-peer --scenario NAME` starts npuserve
(daemon + HTTP front) and llama.cpp's server on the same GGUF, with the same
threads and as many sequences as slots, runs the same requests on both,
round after round in alternating order, and reports each ratio target on
the medians with each round's own (paired) ratio. The targets and how far
from them each run is are in the output (table, or JSON Lines with `kind`:
`row` per run, `target` per verdict, then `summary`).
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from tools.load import scenarios as sc
from tools.load.paired import alternate, per_round
from tools.load.runner import Record
from tools.load.workload import Request


HTTP_THREADS = 128  # llama.cpp's server threads for HTTP connections in the scenarios (see peer_main)


@dataclass
class Route:
    """One server of a run: how to send the requests, and its count of tokens generated (or None)."""

    label: str
    send: Callable[[list[Request]], list[Record]]
    generated: Callable[[], int | None] = lambda: None
    records: dict[int, list[Record]] = field(default_factory=dict)  # per round, for the plots
    requests: dict[int, list[Request]] = field(default_factory=dict)  # what each round sent


def daemon_generated(endpoint: str) -> Callable[[], int | None]:
    """The daemon's `generation_tokens` counter (tokens sampled), over ZeroMQ."""

    def read() -> int | None:
        from engine.errors import ClientError
        from tools.load import local_daemon

        try:
            return int(local_daemon.stats(endpoint)["scheduler"]["counters"]["generation_tokens"])
        except (ClientError, KeyError, TypeError):
            return None
    return read


def metrics_generated(url: str) -> Callable[[], int | None]:
    """An HTTP server's Prometheus count of tokens generated: llama.cpp's `llamacpp:tokens_predicted_total`
    (its `/metrics`, which counts cancelled requests' tokens too) or npuserve's `generation_tokens`."""
    from tools.load.openai_load import base_url

    def read() -> int | None:
        try:
            with urllib.request.urlopen(base_url(url) + "/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return None
        return parse_generated(text)
    return read


def parse_generated(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        if name in ("llamacpp:tokens_predicted_total",) or name.endswith("generation_tokens_total") \
                or name.endswith("generation_tokens"):
            try:
                return int(float(value))
            except ValueError:
                return None
    return None


def settled(read: Callable[[], int | None], pause: float = 0.5, limit: float = 10.0) -> int | None:
    """A server's counter once it stops moving: a server may count a request after its last event went out
    (llama.cpp's `/metrics` at the slot's release) and keeps generating for a client that hung up."""
    import time

    value, waited = read(), 0.0
    while value is not None and waited < limit:
        time.sleep(pause)
        waited += pause
        again = read()
        if again == value:
            break
        value = again
    return value


def run_rounds(s: sc.Scenario, opts: dict, routes: list[Route], make_requests: Callable[[int], list[Request]],
               rounds: int, on_start: Callable[[str], None] | None = None) -> list[dict]:
    """Every round: the same requests over each route, the order flipping every round; one row per run.

    Each round draws its own requests (`make_requests(round)`, a seed per round): both servers cache
    prompts (llama.cpp's server per slot, npuserve's prefix cache), and a prompt seen in the round
    before would skip its prefill."""
    requests_of = per_round(make_requests)

    def run(route: Route, rnd: int, _group) -> dict:
        requests = requests_of(rnd)
        if on_start:
            on_start(f"{s.name} round {rnd + 1}/{rounds}: {route.label}")
        before = route.generated()
        recs = route.send(requests)
        after = settled(route.generated)
        generated = None if before is None or after is None else after - before
        route.records[rnd + 1] = recs
        route.requests[rnd + 1] = requests
        return {"label": route.label, "round": rnd + 1, "scenario": s.name,
                **sc.measure(s, recs, requests, opts, generated)}

    return alternate(routes, rounds, run)


# ------------------------------------------------------------------ output

_SKIP = ("kind", "label", "round", "scenario", "b_ttft_ms", "a_ttft_ms")


def columns(rows: list[dict]) -> list[tuple[str, str]]:
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)
            if k not in _SKIP and not isinstance(next((r[k] for r in rows if k in r), None), (list, dict))]
    return [("label", "run"), ("round", "round")] + [(k, k.removesuffix("_ms").replace("_", " ")) for k in keys]


def format_verdict(v: dict) -> str:
    if v["value"] is None:
        return f"  {v['target']}: -- {v.get('note', '')}"
    head = f"  {v['subject']}: {v['target']}: " + ("met" if v["met"] else "MISSED")
    if v["target_kind"] == "max":
        return head + f" ({v['metric']} {v['value']:g}, margin {v['margin']:+g})"
    line = (head + f" (ratio {v['value']:.3f}: {v['subject_median']:,.1f} vs {v['baseline']} "
            f"{v['baseline_median']:,.1f}, margin {v['margin']:+.3f}")
    if len(v.get("rounds", ())) > 1:
        line += f"; rounds {min(v['rounds']):.3f}-{max(v['rounds']):.3f}"
    if v.get("within_spread"):
        line += ", the bound inside their spread"
    return line + ")"


def report(s: sc.Scenario, opts: dict, title: str, rows: list[dict], verdicts: list[dict], as_json: bool,
           summary: dict) -> int:
    from tools.load.report import publish, table

    met = [v["met"] for v in verdicts if v["met"] is not None]
    summary = {**summary, "scenario": s.name, "options": opts,
               "slo": None if s.slo_of(opts) is None else str(s.slo_of(opts)), "targets_met": all(met) if met else None}

    def text() -> str:
        out = [title, f"options: {', '.join(f'{k}={v:g}' for k, v in opts.items())}"]
        if s.slo_of(opts) is not None:
            out.append(f"SLO: {s.slo_of(opts)} (a request meets it when it finished, TTFT and TPOT within); "
                       f"429s counted apart from SLO misses")
        out += [table(rows, columns(rows)), "(latencies in ms)", "targets:", *map(format_verdict, verdicts)]
        return "\n".join(out)

    lines = [*(("row", r) for r in rows), *(("target", v) for v in verdicts), ("summary", summary)]
    return publish(s.name, as_json, lines, text, [{"errors": r.get("other_errors", r.get("errors", 0))} for r in rows])


def plot(s: sc.Scenario, routes: list[Route], path: str, title: str) -> None:
    """The scenario's picture of the first round (the one run on servers with nothing cached)."""
    from tools.load import scenario_plot

    last = {r.label: r.records[min(r.records)] for r in routes if r.records}
    requests = next(r.requests[min(r.requests)] for r in routes if r.requests)
    if s.plot == "timeline":
        scenario_plot.timeline_png(last, requests, path, title)
    elif s.plot == "ttft_cdf":
        series = {label: {"tenant b": [x.ttft_ms for x in recs if x.tenant == "b" and x.ttft_ms is not None],
                          "tenant a": [x.ttft_ms for x in recs if x.tenant == "a" and x.ttft_ms is not None]}
                  for label, recs in last.items()}
        scenario_plot.ttft_cdf_png(series, path, title)
    else:
        raise SystemExit(f"--plot: scenario {s.name} has no plot (long-prompt and tenant-flood do)")
    print(f"{s.name}: plot written to {path}", file=sys.stderr)


def write_records(routes: list[Route], path: str) -> None:
    """Every request of every run as JSON Lines (label, round, role, stream, and the record's fields), so
    that a metric can be computed again from the trace."""
    import dataclasses

    import orjson

    with open(path, "wb") as f:
        for route in routes:
            for rnd, recs in sorted(route.records.items()):
                req = {r.index: r for r in route.requests[rnd]}
                for rec in recs:
                    q = req.get(rec.index)
                    f.write(orjson.dumps({"kind": "record", "label": route.label, "round": rnd,
                                          "role": q.role if q else None, "stream": q.stream if q else None,
                                          **dataclasses.asdict(rec)}) + b"\n")
    print(f"records written to {path}", file=sys.stderr)


def options_of(pairs: list[str], s: sc.Scenario, quick: bool) -> dict:
    out = {}
    for kv in pairs:
        k, eq, v = kv.partition("=")
        if not eq:
            raise ValueError(f"--scenario-option {kv!r}: expected KEY=VALUE")
        out[k.strip()] = v.strip()
    return s.resolve(out, quick)


# ------------------------------------------------------------------ npuserve bench serve --scenario


def bench_main(a) -> int:
    """`npuserve bench serve --scenario NAME` against one server (parsed by tools.bench.serve.load)."""
    from tools.bench.serve.server import open_server
    from tools.load.progress import Progress

    s = sc.get(a.scenario)
    opts = options_of(a.scenario_option, s, a.quick)
    settings = [f"executor.max_inflight={a.max_inflight}", *a.set]
    with open_server(a, settings, "nps-") as server:
        if a.openai:
            generated, label = metrics_generated(a.openai), "openai"
        else:
            generated, label = daemon_generated(server.endpoint), "endpoint" if a.endpoint else a.backend

        def make_requests(rnd: int) -> list[Request]:
            return s.requests(opts, server.model["vocab_size"], server.model["max_seq"], a.seed + 100 * rnd)

        progress = Progress(len(make_requests(0)) * a.rounds, not a.no_progress)

        def send(reqs: list[Request]) -> list[Record]:
            return server.send(reqs, concurrency=None, clients=a.clients, on_record=progress.record)

        route = Route(label, send, generated)
        try:
            rows = run_rounds(s, opts, [route], make_requests, a.rounds, progress.point)
        finally:
            progress.close()
    verdicts = sc.verdicts(s, rows, label, None)
    title = f"scenario {s.name} on {a.openai or a.endpoint or a.backend}: {s.summary}"
    code = report(s, opts, title, rows, verdicts, a.json, {"target_server": a.openai or a.endpoint or a.backend})
    if a.plot:
        plot(s, [route], a.plot, title)
    if a.records:
        write_records([route], a.records)
    return code


# ------------------------------------------------------------------ bench-http-peer --scenario


def peer_main(a, pkg) -> int:
    """`bench-http-peer --scenario NAME`: npuserve (daemon + front) against llama.cpp's server."""
    from tools.load.progress import Progress
    from tools.load import llamacpp_server, local_front, runner
    from tools.load.openai_load import probe

    s = sc.get(a.scenario)
    opts = options_of(a.scenario_option, s, False)
    def make_requests(rnd: int) -> list[Request]:
        return s.requests(opts, 256, pkg.max_seq, a.seed + 100 * rnd)

    rounds_requests = [make_requests(rnd) for rnd in range(a.rounds)]
    ctx = max(len(r.prompt) + r.max_tokens for reqs in rounds_requests for r in reqs) + 16
    settings = [f"model.package=\"{pkg.path}\"", f"board.threads_per_chip={a.threads}", "executor.max_inflight=1",
                "admission.deadline_default_ms=3600000", f"admission.max_sequences={a.slots}",
                "admission.max_waiting_requests=1024", *a.set]
    progress = Progress(2 * sum(len(x) for x in rounds_requests), not a.no_progress)
    peer = None
    try:
        with local_front.daemon_and_front("bench-http-peer", backend="llamacpp", chips=1, settings=settings,
                                          prefix="nps-") as (d, front, _model):
            # HTTP threads for every connection a scenario opens (a flood's 24 and more): with llama.cpp's
            # default (slots + 2), each bound to one kept-alive connection, the rest would wait for a
            # thread rather than for a slot, which is the client's doing, not the server's scheduling.
            peer = llamacpp_server.start(pkg.gguf_path, threads=a.threads, parallel=a.slots, ctx_per_slot=ctx,
                                         threads_http=HTTP_THREADS)
            urls = {"npuserve": front.url, "llama.cpp": peer.url}
            models = {k: probe(u)["id"] for k, u in urls.items()}

            def sender(name: str):
                def go(reqs: list[Request], on_record=progress.record) -> list[Record]:
                    return runner.run(None, reqs, concurrency=None, clients=a.clients, on_record=on_record,
                                      openai=urls[name], model=models[name])
                return go

            routes = [Route("npuserve", sender("npuserve"), daemon_generated(d.endpoint)),
                      Route("llama.cpp", sender("llama.cpp"), metrics_generated(peer.url))]
            from tools.load.workload import LengthDist, WorkloadSpec, build

            warm = build(WorkloadSpec(4, LengthDist("fixed", 16), LengthDist("fixed", 2), vocab=256, max_seq=ctx,
                                      seed=a.seed + 999))
            for r in routes:  # untimed: first connections and first requests of each engine
                runner.run(None, warm, concurrency=4, clients=1, openai=urls[r.label], model=models[r.label])
            rows = run_rounds(s, opts, routes, rounds_requests.__getitem__, a.rounds, progress.point)
    finally:
        progress.close()
        if peer is not None:
            peer.stop()
    verdicts = sc.verdicts(s, rows, "npuserve", "llama.cpp")
    title = (f"bench-http-peer --scenario {s.name}: {pkg.name}, {a.threads} thread(s) each, {a.slots} sequences = "
             f"{a.slots} slots, {a.rounds} rounds; npuserve = daemon + HTTP front, llama.cpp = its own server; "
             f"both over HTTP. {s.summary}")
    code = report(s, opts, title, rows, verdicts, a.json,
                  {"package": pkg.name, "threads": a.threads, "slots": a.slots, "rounds": a.rounds})
    if a.records:
        write_records(routes, a.records)
    if a.plot:
        plot(s, routes, a.plot, f"{s.name}: npuserve vs llama.cpp's server ({pkg.name}, {a.threads} threads, "
                                          f"{a.slots} slots)")
    return code
