"""The head-to-head scenarios: loads where the scheduler, not the kernels, decides how a server does.

Each scenario is a request generator (its requests, fixed from a seed, with
the arrival time, stream, tenant, hang-up point and role of each), the
metrics it reports (`scenario_metrics`) and its targets against a peer
server (a ratio of the two sides' medians over rounds) or on its own (an
absolute bound). Sizes are parameters (`--scenario-option KEY=VALUE`), with
`quick` sizes for the stub/sim plumbing tests; the defaults fit Gemma 3 270M
on two cores. Pure: no I/O, no clock.

* `long-prompt`: streams decoding; long prompts arrive: the streams' worst
  inter-token gap during the long prefills, the long prompts' TTFT.
* `tenant-flood`: tenant a keeps many more requests outstanding than the
  board has sequences; tenant b sends a few one after another: b's TTFT,
  a's tokens/s. (llama.cpp's server has no tenants: one queue.)
* `burst`: open-loop Poisson arrivals with bursts above capacity: goodput at
  the stated SLO, 429s apart from SLO misses.
* `hangups`: clients hang up mid-stream at a steady rate: the tokens the
  server generated that nobody received, per disconnect; the others' TPOT.
* multi-turn chat (conversations whose working set exceeds the device pool)
  is the conversation workload (`--conversations`), not a scenario here.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tools.load.paired import Target
from tools.load.report import Slo
from tools.load.workload import Request

DEFERRED = {"multi-turn": "multi-turn chat is the conversation workload: `npuserve bench --conversations N --turns T` "
                          "(tiers side by side) or `npuserve bench-http-peer --conversations N --turns T` "
                          "(against llama.cpp's server and its host prompt cache)"}


# How a scenario row names a target's kind: a ratio to the peer's, or a side's own bound.
ROW_KIND = {"max": "ratio_max", "min": "ratio_min", "own_max": "max"}


def describe(t: Target) -> str:
    return str(t) if t.kind == "own_max" else f"{t.metric} {t} the peer's"


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    options: Mapping[str, float]  # sizes, the defaults (Gemma 3 270M, two cores)
    quick: Mapping[str, float]  # overrides for a short plumbing run (stub / sim backends)
    generate: Callable[[dict, random.Random, int, int], list[Request]]  # (options, rng, vocab, max_seq)
    targets: tuple[Target, ...]
    plot: str | None = None  # "timeline" | "ttft_cdf"
    slo: Slo | None = None  # the burst's SLO (option ttft_ms / tpot_ms)
    notes: tuple[str, ...] = field(default=())

    def resolve(self, overrides: Mapping[str, str] | None = None, quick: bool = False) -> dict:
        """The options of a run: defaults, then `quick`, then `overrides` (every key must be known)."""
        opts = dict(self.options)
        if quick:
            opts.update(self.quick)
        for k, v in (overrides or {}).items():
            if k not in opts:
                raise ValueError(f"scenario {self.name}: unknown option {k!r} (options: {', '.join(opts)})")
            try:
                opts[k] = float(v)
            except ValueError:
                raise ValueError(f"scenario {self.name}: option {k}={v!r} is not a number") from None
        return opts

    def requests(self, opts: Mapping[str, float], vocab: int = 256, max_seq: int = 4096, seed: int = 42
                 ) -> list[Request]:
        reqs = self.generate(dict(opts), random.Random(seed), max(2, min(vocab, 256)), max_seq)
        for r in reqs:
            assert len(r.prompt) + r.max_tokens <= max_seq, (self.name, r.index, len(r.prompt), r.max_tokens)
        return reqs

    def slo_of(self, opts: Mapping[str, float]) -> Slo | None:
        if "ttft_ms" not in opts:
            return None
        return Slo(ttft_ms=opts["ttft_ms"], tpot_ms=opts["tpot_ms"])


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def _fit(prompt: int, output: int, max_seq: int) -> tuple[int, int]:
    prompt = max(1, min(prompt, max_seq - 2))
    return prompt, max(1, min(output, max_seq - prompt))


def _long_prompt(o: dict, rng: random.Random, vocab: int, max_seq: int) -> list[Request]:
    """`streams` streams, each a background run of `per_stream` requests (repeated if need be, so they
    decode for as long as the long prompts take on either server); `longs` long prompts sent at `long_at`
    seconds, once every stream has finished a request (so the streams are generating when they arrive)."""
    out: list[Request] = []
    sp, so = _fit(int(o["stream_prompt"]), int(o["stream_output"]), max_seq)
    for s in range(int(o["streams"])):
        for _ in range(int(o["per_stream"])):
            i = len(out)
            out.append(Request(i, _ids(rng, sp, vocab), so, seed=i, stream=s, background=True, role="stream"))
    lp, lo = _fit(int(o["long_prompt"]), int(o["long_output"]), max_seq)
    for k in range(int(o["longs"])):
        i = len(out)
        out.append(Request(i, _ids(rng, lp, vocab), lo, seed=i, at=o["long_at"], role="long",
                           after_streams=True))
    return out


def _tenant_flood(o: dict, rng: random.Random, vocab: int, max_seq: int) -> list[Request]:
    """Tenant a: `flood_streams` streams of background requests; tenant b: `b_requests` one after
    another from `b_at` seconds."""
    out: list[Request] = []
    ap, ao = _fit(int(o["a_prompt"]), int(o["a_output"]), max_seq)
    for s in range(int(o["flood_streams"])):
        for _ in range(int(o["per_stream"])):
            i = len(out)
            out.append(Request(i, _ids(rng, ap, vocab), ao, seed=i, tenant="a", stream=s, background=True,
                               role="a"))
    bp, bo = _fit(int(o["b_prompt"]), int(o["b_output"]), max_seq)
    b_stream = int(o["flood_streams"])
    for _ in range(int(o["b_requests"])):
        i = len(out)
        out.append(Request(i, _ids(rng, bp, vocab), bo, seed=i, tenant="b", stream=b_stream, at=o["b_at"],
                           role="b"))
    return out


def burst_arrivals(rng: random.Random, rate: float, duration: float, every: float, size: int,
                   spread: float) -> list[float]:
    """Poisson arrivals at `rate` over `duration` seconds, plus a burst of `size` arrivals spread
    uniformly over `spread` seconds every `every` seconds (the first at `every / 2`), sorted."""
    times = []
    t = rng.expovariate(rate) if rate > 0 else duration
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    b = every / 2
    while every > 0 and b < duration:
        times += [b + rng.uniform(0.0, spread) for _ in range(size)]
        b += every
    return sorted(times)


def _burst(o: dict, rng: random.Random, vocab: int, max_seq: int) -> list[Request]:
    times = burst_arrivals(rng, o["rate"], o["duration_s"], o["burst_every_s"], int(o["burst_size"]),
                           o["burst_spread_s"])
    out = []
    for i, at in enumerate(times):
        p, g = _fit(rng.randint(int(o["prompt_min"]), int(o["prompt_max"])),
                    rng.randint(int(o["output_min"]), int(o["output_max"])), max_seq)
        out.append(Request(i, _ids(rng, p, vocab), g, seed=i, at=round(at, 4), role="burst"))
    return out


def _hangups(o: dict, rng: random.Random, vocab: int, max_seq: int) -> list[Request]:
    """`streams` streams of `per_stream` requests; every `hangup_every`-th request hangs up after a
    number of tokens drawn from [hangup_min, hangup_max] (a steady rate of disconnects)."""
    out = []
    p, g = _fit(int(o["prompt"]), int(o["output"]), max_seq)
    every = int(o["hangup_every"])
    for s in range(int(o["streams"])):
        for k in range(int(o["per_stream"])):
            i = len(out)
            cut = None
            if every > 0 and (i % every) == every - 1:
                cut = min(g - 1, rng.randint(int(o["hangup_min"]), int(o["hangup_max"])))
            out.append(Request(i, _ids(rng, p, vocab), g, seed=i, stream=s, disconnect_after=cut,
                               role="hangup" if cut else "other"))
    return out


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        "long-prompt", "streams decoding while long prompts arrive: their worst gap, the long prompts' TTFT",
        options={"streams": 6, "per_stream": 40, "stream_prompt": 64, "stream_output": 64, "longs": 2,
                 "long_prompt": 1500, "long_output": 8, "long_at": 4.0},
        quick={"streams": 3, "per_stream": 20, "stream_prompt": 16, "stream_output": 16, "longs": 1,
               "long_prompt": 200, "long_output": 4, "long_at": 0.3},
        generate=_long_prompt,
        targets=(Target("worst_gap_ms", "max", 0.5), Target("long_ttft_max_ms", "max", 1.2)),
        plot="timeline"),
    Scenario(
        "tenant-flood", "tenant a floods, tenant b sends a few: b's TTFT, a's tokens/s",
        options={"flood_streams": 24, "per_stream": 40, "a_prompt": 64, "a_output": 64, "b_requests": 4,
                 "b_prompt": 64, "b_output": 32, "b_at": 4.0},
        quick={"flood_streams": 6, "per_stream": 20, "a_prompt": 16, "a_output": 16, "b_requests": 2,
               "b_prompt": 16, "b_output": 8, "b_at": 0.3},
        generate=_tenant_flood,
        targets=(Target("b_ttft_p50_ms", "max", 0.15), Target("a_tokens_per_s", "min", 0.95)),
        plot="ttft_cdf"),
    Scenario(
        "burst", "open-loop Poisson arrivals with bursts above capacity: goodput at the SLO",
        options={"rate": 0.5, "duration_s": 40.0, "burst_every_s": 10.0, "burst_size": 12, "burst_spread_s": 0.5,
                 "prompt_min": 32, "prompt_max": 256, "output_min": 16, "output_max": 64,
                 "ttft_ms": 3000.0, "tpot_ms": 200.0},
        quick={"rate": 10.0, "duration_s": 1.5, "burst_every_s": 1.0, "burst_size": 8, "burst_spread_s": 0.1,
               "prompt_min": 8, "prompt_max": 32, "output_min": 4, "output_max": 16},
        generate=_burst,
        targets=(Target("goodput_requests_per_s", "min", 1.2),)),
    Scenario(
        "hangups", "clients hanging up mid-stream: tokens generated for nobody, the others' TPOT",
        options={"streams": 8, "per_stream": 6, "prompt": 64, "output": 128, "hangup_every": 2,
                 "hangup_min": 4, "hangup_max": 48},
        quick={"streams": 4, "per_stream": 4, "prompt": 16, "output": 32, "hangup_min": 2, "hangup_max": 8},
        generate=_hangups,
        targets=(Target("wasted_per_disconnect", "own_max", 1.0),)),
)}


def get(name: str) -> Scenario:
    if name in DEFERRED:
        raise ValueError(f"scenario {name}: {DEFERRED[name]}")
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; one of {', '.join(SCENARIOS)}")
    return SCENARIOS[name]


def measure(s: Scenario, records, requests: list[Request], opts: Mapping[str, float],
            server_generated: int | None = None) -> dict:
    """The scenario's metrics of one run (`scenario_metrics`)."""
    from tools.load import scenario_metrics as m

    if s.name == "long-prompt":
        return m.long_prompt(records, requests)
    if s.name == "tenant-flood":
        return m.tenant_flood(records, requests)
    if s.name == "burst":
        return m.burst(records, s.slo_of(opts))
    if s.name == "hangups":
        return m.hangups(records, server_generated)
    raise AssertionError(s.name)


def verdicts(s: Scenario, rows: list[dict], subject: str, baseline: str | None) -> list[dict]:
    """Each target of `s` on `rows` (one per run: label, round, metrics): a ratio of the medians over
    rounds (with each round's own ratio: paired, so their spread is the machine's drift), or each side's
    own median against an absolute bound. A ratio target without a baseline is reported as not run."""
    import statistics

    from tools.load.paired import bound_within, round_values

    def median(label: str, metric: str):
        vals = [r[metric] for r in rows if r["label"] == label and r.get(metric) is not None]
        return statistics.median(vals) if vals else None

    out = []
    for t in s.targets:
        row: dict = {"scenario": s.name, "target": describe(t), "metric": t.metric, "target_kind": ROW_KIND[t.kind],
                     "bound": t.bound}
        if t.kind == "own_max":
            for label in [subject] + ([baseline] if baseline else []):
                v = median(label, t.metric)
                out.append({**row, "subject": label, "value": v, "met": None if v is None else t.met(v),
                            "margin": None if v is None else t.margin(v)})
            continue
        sv = median(subject, t.metric)
        bv = median(baseline, t.metric) if baseline else None
        if baseline is None or sv is None or not bv:
            out.append({**row, "subject": subject, "baseline": baseline, "value": None, "met": None,
                        "margin": None, "subject_median": sv, "baseline_median": bv,
                        "note": "needs a peer: `npuserve bench-http-peer --scenario " + s.name + "`"
                        if baseline is None else "no value on one side"})
            continue
        ratio = round(sv / bv, 3)
        per_round = round_values(rows, subject, baseline, t.metric, False)
        out.append({**row, "subject": subject, "baseline": baseline, "subject_median": sv, "baseline_median": bv,
                    "value": ratio, "met": t.met(ratio), "margin": t.margin(ratio), "rounds": per_round,
                    "within_spread": bound_within(per_round, t.bound)})
    return out
