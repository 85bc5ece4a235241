"""`npuserve bench serve disagg`: prefill/decode disaggregation against co-location on the same two boards.

One run starts two `sim` board daemons (one chip each, tcp://) and two
balancers over them: `disaggregated` (board 0 prefills, board 1 decodes:
`--prefill`/`--decode`) and `co-located` (both boards mixed, least load).
Both sides drive the same two boards, so the hardware is equal by
construction; at each arrival rate (open loop, Poisson) both sides get the
same requests, in ABBA order across rates, and the table gives TTFT/TPOT
P99 and goodput at `--slo` side by side. The verdict: at the lowest rate
where co-located TPOT P99 breaks the SLO, disaggregated goodput / co-located
goodput against the target (>= 1.3x).

`--transfer` says how the decode board gets a handed-off prompt's KV: from
the prefill board's block files (`disk`, the default), pulled over ZeroMQ
(`zmq`), or not at all (`none`: it recomputes every prompt, which shows what
the split costs without a transfer); docs/disaggregation.md.

Beside each row the cost model's goodput for that side and rate
(engine/balancer/pd_cost.py, from the sim's latency model: `model good/s`),
and beside the verdict the model's bound on the ratio at the break point
(`limit` lines). The disaggregated balancer hands off only prompts of at
least `--pd-min-prompt` tokens (by default the model's shortest prompt whose
import costs the decode board less than computing it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys

from tools.bench.options import add
from tools.bench.serve.disagg_model import predicted_goodput
from tools.json_lines import emit
from tools.load import local_daemon, paired, runner
from tools.load.fleet import Fleet
from tools.load.ports import free_port
from tools.load.report import Slo, publish, summarize, table
from tools.load.workload import LengthDist, WorkloadSpec, build

SIDES = ("disaggregated", "co-located")
TARGET_GOODPUT_RATIO = 1.3
COLUMNS = [("label", "side"), ("rate", "rate/s"), ("requests", "reqs"), ("errors", "err"),
           ("tokens_per_s", "tok/s"), ("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
           ("tpot_p50_ms", "TPOT p50"), ("tpot_p99_ms", "TPOT p99"), ("slo_met", "met"),
           ("goodput_requests_per_s", "good req/s"), ("goodput_tokens_per_s", "good tok/s"),
           ("model_goodput", "model good/s")]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="npuserve bench serve disagg", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1,2,3,4", help="arrival rates (requests/s), comma-separated")
    p.add_argument("--seconds", type=float, default=12.0, help="seconds of arrivals per point")
    p.add_argument("--prompt", default="fixed:1536", help="prompt lengths (as `npuserve bench --prompt`)")
    p.add_argument("--output", default="fixed:64", help="output lengths")
    p.add_argument("--slo", default="ttft=1s,tpot=40ms", help="goodput SLO (as `npuserve bench --slo`)")
    p.add_argument("--max-inflight", type=int, default=2, help="each board's executor.max_inflight")
    add(p, "backend-option")
    p.add_argument("--transfer", choices=("disk", "zmq", "none"), default="disk",
                   help="disk: both boards get a disk KV tier and the decode board imports the prefill board's "
                        "blocks (board.handoff_peer_dirs); zmq: both get a disk tier of their own and the decode "
                        "board pulls the blocks from the prefill board's board.handoff_endpoint; none: the decode "
                        "board recomputes every prompt")
    p.add_argument("--pd-min-prompt", type=int, metavar="TOKENS",
                   help="the disaggregated balancer's routing.pd_min_prompt_tokens (default: the cost model's "
                        "shortest prompt worth a hand-off; 0: every prompt)")
    add(p, "json", "plot", seed=27, helps={"plot": "TPOT P99 and goodput against the rate (needs matplotlib)"})
    a = p.parse_args(argv)
    try:
        a.rate_list = [float(x) for x in a.rates.split(",") if x.strip()]
        a.prompt_dist, a.output_dist = LengthDist.parse(a.prompt), LengthDist.parse(a.output)
        a.slo_obj = Slo.parse(a.slo)
    except ValueError as e:
        p.error(str(e))
    if not a.rate_list or min(a.rate_list) <= 0:
        p.error("--rates must be positive numbers")
    if a.pd_min_prompt is not None and a.pd_min_prompt < 0:
        p.error("--pd-min-prompt must be >= 0")
    from engine.config_schema import ConfigError
    from tools.bench.serve import disagg_model

    try:
        a.costs = disagg_model.sim_costs(a.backend_option, a.max_inflight)
    except (ConfigError, TypeError, ValueError) as e:
        p.error(f"--backend-option: {e}")
    a.model_load = disagg_model.load_of(a.prompt_dist.mean, a.output_dist.mean, a.slo_obj)
    if a.pd_min_prompt is None:
        from engine.balancer.pd_cost import min_split_prompt

        a.pd_min_prompt = min_split_prompt(a.costs) or 0  # import never pays: still hand off (what is measured)
    if a.plot:
        from tools.load.plot import require_matplotlib

        require_matplotlib()
    return a


def _board(fleet: Fleet, i: int, a: argparse.Namespace) -> str:
    """Board i of the two (one sim chip each); with a transfer, board 1 (the disaggregated side's decode
    board) gets board 0's blocks."""
    sets = [f"executor.max_inflight={a.max_inflight}"]
    if a.transfer in ("disk", "zmq"):
        sets.append(f"kv.disk_dir={os.path.join(fleet.dir, f'kv{i}')}")
        if i == 1 and a.transfer == "disk":
            sets.append(f"board.handoff_peer_dirs=[\"{os.path.join(fleet.dir, 'kv0')}\"]")
        if i == 0 and a.transfer == "zmq":
            sets.append(f"board.handoff_endpoint=\"tcp://127.0.0.1:{free_port()}\"")
    return fleet.daemon("sim", f"bd{i}", sets, a.backend_option)


def _handoffs(endpoint: str) -> dict:
    from engine.client import Client

    with Client(endpoint, timeout=10) as c:
        d = c.stats()["daemon"]
    out = {k: d.get(k, 0) for k in ("handoff_exports", "handoff_imported", "handoff_recomputed",
                                    "handoff_staged_blocks", "handoff_pulled_blocks", "handoff_pull_failed",
                                    "handoff_released", "handoff_pull_us")}
    with Client(endpoint, timeout=10) as c:
        counters = c.stats()["scheduler"]["counters"]
    out["tier_hit_tokens"] = counters.get("tier_hit_tokens", 0)
    out["prefill_tokens"] = counters.get("prefill_tokens", 0)
    return out


def fresh_prompts(reqs: list, seed: int) -> list:
    """The same lengths and arrival times with new token ids: the two sides share the boards, and a prompt
    the other side already sent would be a prefix-cache hit."""
    rng = random.Random(seed)
    return [dataclasses.replace(r, prompt=[rng.randrange(1, 256) for _ in r.prompt]) for r in reqs]


def verdict(rows: list[dict], slo: Slo) -> dict:
    """At the lowest rate where co-located TPOT P99 breaks the SLO: the goodput ratio against the target."""
    by = {(r["label"], r["rate"]): r for r in rows}
    rates = sorted({r["rate"] for r in rows})
    ratios = {}
    for rate in rates:
        d, c = by.get(("disaggregated", rate)), by.get(("co-located", rate))
        if d and c:
            ratios[rate] = round((d.get("goodput_requests_per_s") or 0) / max(c.get("goodput_requests_per_s")
                                                                           or 0, 1e-9), 3)
    broken = [rate for rate in rates if slo.tpot_ms is not None and (by.get(("co-located", rate)) or {}).get(
        "tpot_p99_ms") is not None and by[("co-located", rate)]["tpot_p99_ms"] > slo.tpot_ms]
    at = broken[0] if broken else None
    ratio = ratios.get(at) if at is not None else None
    return {"slo": str(slo), "goodput_ratio_by_rate": {str(k): v for k, v in ratios.items()},
            "co_located_tpot_breaks_at_rate": at, "goodput_ratio_there": ratio,
            "target_goodput_ratio": TARGET_GOODPUT_RATIO,
            "met": None if ratio is None else ratio >= TARGET_GOODPUT_RATIO,
            "vs_target": None if ratio is None else round(ratio / TARGET_GOODPUT_RATIO, 3)}


def limits(rows: list[dict], v: dict, a: argparse.Namespace | None = None) -> list:
    """The goodput ratio at the break point beside its bounds: every request offered at that rate meeting the
    SLO, over the co-located goodput measured there (lim.offered) and over the cost model's (with `a`)."""
    from tools.bench.serve import disagg_model
    from tools.load import limits as lim

    at = v["co_located_tpot_breaks_at_rate"]
    co = next((r for r in rows if r["label"] == "co-located" and r["rate"] == at), None)
    model = [] if a is None else [disagg_model.limit(a.costs, a.model_load, v["goodput_ratio_there"], at,
                                                     TARGET_GOODPUT_RATIO)]
    if at is None or co is None:
        return [lim.unmodelled("disaggregated / co-located goodput", None, f">= {TARGET_GOODPUT_RATIO}x",
                               "no break point: co-located TPOT P99 met the SLO at every rate"), *model]
    return [lim.offered(f"disaggregated / co-located goodput at {at:g} req/s", v["goodput_ratio_there"], at,
                        co.get("goodput_requests_per_s"), f">= {TARGET_GOODPUT_RATIO}x"), *model]


def run(a: argparse.Namespace) -> dict:
    fleet = Fleet("npsbd-")
    rows: list[dict] = []
    try:
        boards = [_board(fleet, i, a) for i in range(2)]
        for e in boards:
            local_daemon.wait_healthy(e, timeout=120)
        routes = {"disaggregated": fleet.balancer(["--prefill", boards[0], "--decode", boards[1],
                                                   "--policy", "least-load", "--pd-min-prompt",
                                                   str(a.pd_min_prompt)], "pd").endpoint,
                  "co-located": fleet.balancer(["--backends", ",".join(boards), "--policy", "least-load"],
                                               "mixed").endpoint}
        for ep in routes.values():
            local_daemon.wait_healthy(ep, timeout=120, backends_up=2)
        before = [_handoffs(e) for e in boards]

        def base(i: int) -> tuple[int, list]:
            n = max(8, int(a.rate_list[i] * a.seconds))
            return n, build(WorkloadSpec(n, a.prompt_dist, a.output_dist, vocab=256, max_seq=2048,
                                         rate=a.rate_list[i], seed=a.seed + i))

        base = paired.per_round(base)

        def run_side(side: str, i: int, _group) -> dict:  # a round: one rate, both sides
            rate, (n, reqs) = a.rate_list[i], base(i)
            reqs = fresh_prompts(reqs, a.seed * 1000 + 2 * i + SIDES.index(side))
            if not a.json:
                print(f"bench-disagg: {side} at {rate:g} req/s ({n} requests) ...", file=sys.stderr, flush=True)
            recs = runner.run([routes[side]], reqs, concurrency=None, clients=1)
            row = {"label": side, "rate": rate, **summarize(recs, a.slo_obj),
                   "model_goodput": predicted_goodput(a.costs, a.model_load, side, rate)}
            if a.json:
                emit("row", row)
            return row

        rows = paired.alternate(SIDES, len(a.rate_list), run_side)
        after = [_handoffs(e) for e in boards]
    finally:
        fleet.close()
    handoffs = {f"board{i}": {k: after[i][k] - before[i][k] for k in after[i]} for i in range(2)}
    return {"rows": rows, "verdict": verdict(rows, a.slo_obj), "handoffs": handoffs,
            "workload": {"prompt": str(a.prompt_dist), "output": str(a.output_dist), "seconds": a.seconds,
                         "backend": "sim", "boards": 2, "max_inflight": a.max_inflight, "transfer": a.transfer,
                         "backend_options": a.backend_option, "pd_min_prompt": a.pd_min_prompt},
            "model": model_summary(a)}


def model_summary(a: argparse.Namespace) -> dict:
    """The cost model's inputs and what it predicts for this workload (engine/balancer/pd_cost.py)."""
    from engine.balancer.pd_cost import compare

    c = a.costs
    return {"costs": {k: getattr(c, k) for k in ("prefill_s_per_token", "decode_base_s", "decode_per_lane_s",
                                                  "import_base_s", "import_s_per_block", "host_s", "block_size",
                                                  "max_lanes", "inflight", "chunk_tokens")},
            **{k: v for k, v in compare(c, a.model_load).items()
               if k in ("break_rate", "ratio_at_break", "bound_at_break", "capacity_co_located", "capacity_split",
                        "capacity_ratio", "min_split_prompt", "min_winning_prompt")}}


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    for i, side in enumerate(SIDES):
        pts = sorted((r for r in rows if r["label"] == side), key=lambda r: r["rate"])
        x = [r["rate"] for r in pts]
        ax1.plot(x, [r.get("tpot_p99_ms") for r in pts], marker="os"[i], label=side, color=f"C{i}")
        ax1.plot(x, [r.get("ttft_p99_ms") for r in pts], marker="os"[i], linestyle=":", color=f"C{i}",
                 label=f"{side} TTFT")
        ax2.plot(x, [r.get("goodput_requests_per_s") for r in pts], marker="os"[i], label=side, color=f"C{i}")
    ax1.set_yscale("log")
    ax1.set_xlabel("arrival rate (requests/s)")
    ax1.set_ylabel("P99 ms (TPOT solid, TTFT dotted; log)")
    ax2.set_xlabel("arrival rate (requests/s)")
    ax2.set_ylabel("goodput (requests/s meeting the SLO)")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    res = run(a)
    v = res["verdict"]
    title = (f"sim, 2 boards: 1 prefill + 1 decode vs 2 mixed; prompt {a.prompt}, output {a.output}, "
             f"SLO {a.slo}, transfer {a.transfer}")
    if a.plot:
        plot(res["rows"], a.plot, title)

    def text() -> str:
        if v["co_located_tpot_breaks_at_rate"] is None:
            verdict = (f"co-located TPOT P99 met the SLO ({a.slo}) at every rate: no break point; goodput ratios by "
                       f"rate {v['goodput_ratio_by_rate']}")
        else:
            verdict = (f"co-located TPOT P99 breaks {a.slo} at {v['co_located_tpot_breaks_at_rate']:g} req/s: "
                       f"disaggregated goodput {v['goodput_ratio_there']}x co-located, target >= "
                       f"{TARGET_GOODPUT_RATIO}x ({'met' if v['met'] else 'MISSED'}, {v['vs_target']} of target)")
        m = res["model"]
        co, sp, br = m.get("capacity_co_located") or (0, 0), m.get("capacity_split") or (0, 0), m.get("break_rate")
        model = (f"cost model (the sim's costs): most goodput co-located {co[1]:g} req/s (offered {co[0]:g}), "
                 f"1 prefill + 1 decode {sp[1]:g} (offered {sp[0]:g}): {m.get('capacity_ratio')}x; co-located TPOT "
                 f"P99 passes the SLO " + (f"from {br:g} req/s (bound there {m.get('bound_at_break')}x)" if br
                                            else "at no rate before co-location saturates") +
                 f"; a hand-off pays from {m.get('min_split_prompt')} prompt tokens (--pd-min-prompt "
                 f"{a.pd_min_prompt}), the split's capacity wins from {m.get('min_winning_prompt')}")
        return "\n".join([f"bench-disagg: {title}", table(res["rows"], COLUMNS), f"hand-offs: {res['handoffs']}",
                          verdict, model])

    publish("bench-disagg", a.json, [("summary", {"verdict": v, "handoffs": res["handoffs"],
                                                  "workload": res["workload"], "model": res["model"]})], text,
            limits=limits(res["rows"], v, a))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
