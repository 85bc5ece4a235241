"""The cost model of prefill/decode disaggregation: predicted goodput of co-located and split routing.

Pure arithmetic over measured costs (the `sim` backend's latency model gives
them: `Costs.from_sim`): which prompts are worth a hand-off (the balancer's
`routing.pd_min_prompt_tokens`), which prefill:decode split of the boards has
the most goodput, and what a benchmark's figure could be at best. A board
is one device running one job at a time; its decode streams are stalled by
every other job it runs (a co-located board's prompt chunks, a decode
board's KV imports). Per board, with `r` requests/s:

    T    mean inter-token time = R(b) / (1 - r * X)     R(b): a round of decode jobs over b streams
    b    streams decoding      = r * (O - 1) * T        (Little's law; solved as a fixed point)
    X    stall per request     = the prompt's prefill (co-located) or its KV import (decode board)

A request's own TPOT is R(b) + (own + K * X) / (O - 1), K ~ Poisson(r * (O - 1) * T)
(the stalls that land in its life), so the share meeting the TPOT SLO is a
Poisson CDF. TTFT is a prompt's prefill service S plus an M/D/1 wait
(P(W > t) ~= rho * exp(-2 (1 - rho) t / S)); on a co-located board S holds
the decode jobs the scheduler's weighted round robin puts between its chunks,
and the board saturates (rho >= 1: TTFT unbounded, nothing meets the SLO in
steady state) when prompts need more than their share of the picks.
Goodput = rate * P(TTFT met) * P(TPOT met). Mean values and Poisson tails:
an estimate of where the curves cross, not a simulator (engine/sim is
one); docs/disaggregation.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_GRID = 0.05  # requests/s between the rates the searches try


@dataclass(frozen=True)
class Costs:
    """What a board's device spends, in seconds, and the scheduler settings that shape it."""

    prefill_s_per_token: float
    decode_base_s: float  # one decode job, weights streamed once
    decode_per_lane_s: float
    import_base_s: float = 0.0  # one KV import job (the decode leg's)
    import_s_per_block: float = 0.0
    handoff_s: float = 0.0  # a decode leg's fixed cost on its board beyond the import (admission, its own job)
    host_s: float = 0.0  # per job, the host side before the compute: adds to each job with one in flight
    block_size: int = 16
    max_lanes: int = 16  # the largest decode batch profile
    inflight: int = 1  # executor.max_inflight: a board's streams alternate between this many decode jobs
    chunk_tokens: int = 512  # batch.prefill_chunk_tokens
    decode_weight: int = 8  # the scheduler's round robin between decode jobs and prompt chunks (queues.*_weight)
    prefill_weights: tuple = ((512, 4), (4096, 2), (None, 1))  # (longest prompt of the class, its weight)

    def __post_init__(self) -> None:
        if self.prefill_s_per_token <= 0 or self.decode_base_s <= 0:
            raise ValueError("prefill_s_per_token and decode_base_s must be > 0")
        if min(self.decode_per_lane_s, self.import_base_s, self.import_s_per_block, self.handoff_s, self.host_s) < 0:
            raise ValueError("decode_per_lane_s, import_base_s, import_s_per_block, handoff_s and host_s must be >= 0")
        if min(self.block_size, self.max_lanes, self.inflight, self.chunk_tokens, self.decode_weight) < 1:
            raise ValueError("block_size, max_lanes, inflight, chunk_tokens and decode_weight must be >= 1")

    @classmethod
    def from_sim(cls, latency, kv_block_bytes_model: int = 2 << 20, transfer_gbps: float = 25.0,
                 transfer_base_ms: float = 0.05, **settings) -> Costs:
        """From the `sim` backend's `LatencyModel` and transfer options (its defaults: the sim's)."""
        return cls(prefill_s_per_token=latency.prefill_seconds(1) - latency.prefill_seconds(0),
                   decode_base_s=latency.decode_seconds(0),
                   decode_per_lane_s=latency.decode_seconds(1) - latency.decode_seconds(0),
                   import_base_s=transfer_base_ms / 1000.0,
                   import_s_per_block=kv_block_bytes_model / (transfer_gbps * 1e9),
                   host_s=latency.host_ms / 1000.0, **settings)

    def job_host_s(self) -> float:
        """The host side of a job where it is not hidden behind the previous job's compute."""
        return self.host_s if self.inflight == 1 else 0.0

    def prefill_s(self, tokens: int) -> float:
        """A prompt's prefill on a board: its chunks, one job each."""
        return tokens * self.prefill_s_per_token + math.ceil(tokens / self.chunk_tokens) * self.job_host_s()

    def imported_blocks(self, prompt: int) -> int:
        """The full blocks a decode leg imports: all before the prompt's last token (it is computed)."""
        return max(prompt - 1, 0) // self.block_size

    def import_s(self, prompt: int) -> float:
        """A decode leg's own work before its second token: the import job, then the prompt's tail and the
        streamed first token computed."""
        n = self.imported_blocks(prompt)
        base = self.import_base_s + n * self.import_s_per_block if n else 0.0
        return self.handoff_s + base + self.prefill_s(prompt - n * self.block_size + 1)

    def prefill_weight(self, prompt: int) -> int:
        return next(w for top, w in self.prefill_weights if top is None or prompt <= top)

    def round_jobs(self, streams: float) -> float:
        """The decode jobs that give each of a board's streams one token: one per `max_lanes`, and with
        several jobs in flight the streams spread over them, min(inflight, 1 + N) jobs for a stream that
        shares the board with N ~ Poisson(streams) others (one job when it runs alone)."""
        k = self.inflight
        spread = sum((1 + n) * (poisson_cdf(n, streams) - poisson_cdf(n - 1, streams)) for n in range(k - 1)) \
            + k * (1.0 - poisson_cdf(k - 2, streams))
        return max(1.0, spread, streams / self.max_lanes)

    def round_s(self, streams: float) -> float:
        """Every stream of a board gets one token: its decode jobs, each streaming the weights once."""
        return self.round_jobs(streams) * (self.decode_base_s + self.job_host_s()) + streams * self.decode_per_lane_s


@dataclass(frozen=True)
class Load:
    """One workload: arrivals (Poisson, requests/s), prompt and output tokens, and the goodput SLO."""

    rate: float
    prompt: int
    output: int
    slo_ttft_s: float | None
    slo_tpot_s: float | None

    def __post_init__(self) -> None:
        if self.rate < 0 or self.prompt < 1 or self.output < 1:
            raise ValueError("rate must be >= 0, prompt and output >= 1")

    def at(self, rate: float) -> Load:
        return Load(rate, self.prompt, self.output, self.slo_ttft_s, self.slo_tpot_s)


@dataclass(frozen=True)
class Prediction:
    goodput: float  # requests/s meeting the SLO
    ttft_met: float  # share of requests meeting the TTFT SLO
    tpot_met: float
    tpot_mean_s: float | None  # None: the board cannot keep up (unbounded)
    tpot_p99_s: float | None
    ttft_s: float | None  # a prompt's service time, before any queueing wait
    stable: bool

    def to_dict(self) -> dict:
        r = (lambda x: None if x is None else round(x, 4))
        return {"goodput": r(self.goodput), "ttft_met": r(self.ttft_met), "tpot_met": r(self.tpot_met),
                "tpot_mean_ms": r(self.tpot_mean_s and self.tpot_mean_s * 1000),
                "tpot_p99_ms": r(self.tpot_p99_s and self.tpot_p99_s * 1000),
                "ttft_ms": r(self.ttft_s and self.ttft_s * 1000), "stable": self.stable}


def poisson_cdf(k: int, mu: float) -> float:
    """P(K <= k) for K ~ Poisson(mu)."""
    if k < 0:
        return 0.0
    if mu <= 0:
        return 1.0
    term = total = math.exp(-mu)
    for i in range(1, k + 1):
        term *= mu / i
        total += term
    return min(total, 1.0)


def poisson_quantile(q: float, mu: float) -> int:
    k = 0
    while poisson_cdf(k, mu) < q:
        k += 1
    return k


def decode_interval(costs: Costs, rate: float, output: int, stall_s: float) -> tuple[float, float] | None:
    """(T, b): a board's mean inter-token time and streams at `rate` requests/s, each stalling it `stall_s`;
    None when the board cannot keep up."""
    busy = rate * stall_s
    if busy >= 1.0:
        return None
    t = costs.round_s(0.0) / (1.0 - busy)
    for _ in range(5000):  # T grows monotonically to the fixed point (or without bound)
        b = rate * (output - 1) * t
        nxt = costs.round_s(b) / (1.0 - busy)
        if b > 1e6:
            return None
        if abs(nxt - t) <= 1e-10 * t:
            break
        t = nxt
    else:
        return None  # so slow to settle that the board is at the edge of keeping up
    return t, rate * (output - 1) * t


def ttft_met(service_s: float, rate: float, slo_s: float | None) -> float:
    """Share of prompts served within `slo_s` by one queue of deterministic `service_s` at `rate` (M/D/1)."""
    rho = rate * service_s
    if rho >= 1.0:
        return 0.0
    if slo_s is None:
        return 1.0
    if slo_s < service_s:
        return 0.0
    if rho == 0:
        return 1.0
    return 1.0 - rho * math.exp(-2.0 * (1.0 - rho) * (slo_s - service_s) / service_s)


def _tpot(costs: Costs, load: Load, rate: float, stall_s: float, own_s: float) -> tuple:
    """(mean, p99, share meeting the SLO, round time) of a stream's TPOT on a board; (None, None, 0, None)
    when its decode cannot keep up."""
    td = decode_interval(costs, rate, load.output, stall_s)
    if td is None:
        return None, None, 0.0, None
    t, b = td
    steps = max(load.output - 1, 1)
    rnd = costs.round_s(b)
    mu = rate * steps * t
    p99 = rnd + (own_s + poisson_quantile(0.99, mu) * stall_s) / steps
    mean = rnd + (own_s + mu * stall_s) / steps
    if load.slo_tpot_s is None or load.output < 2:
        return mean, p99, 1.0, rnd
    room = steps * (load.slo_tpot_s - rnd) - own_s
    if room < 0:
        return mean, p99, 0.0, rnd
    kmax = math.floor(room / stall_s) if stall_s > 0 else 10**9
    return mean, p99, (poisson_cdf(kmax, mu) if stall_s > 0 else 1.0), rnd


def colocated(costs: Costs, load: Load, boards: int = 2) -> Prediction:
    """Every board prefills and decodes its share (least load spreads the requests evenly)."""
    rate = load.rate / boards
    stall = costs.prefill_s(load.prompt)
    td = decode_interval(costs, rate, load.output, stall)
    if td is None:
        return Prediction(0.0, 0.0, 0.0, None, None, None, False)
    _, b = td
    # Between two prompt chunks the round robin runs decode_weight / weight decode jobs, when streams run.
    chunks = load.prompt / costs.chunk_tokens
    gaps = chunks * costs.decode_weight / costs.prefill_weight(load.prompt)
    busy_share = 1.0 - math.exp(-b)
    job = costs.round_s(max(b, 1.0)) / costs.round_jobs(max(b, 1.0))
    service = stall + gaps * job * busy_share
    tt = ttft_met(service, rate, load.slo_ttft_s)
    stable = rate * service < 1.0
    # Saturated, the board runs prompts only as fast as their share of the picks lets it: the streams'
    # stalls come at that pace, and the prompts queue without bound (TTFT, not TPOT, fails).
    mean, p99, tp, _ = _tpot(costs, load, rate if stable else 1.0 / service, stall, 0.0)
    return Prediction(load.rate * tt * tp, tt, tp, mean, p99, service, stable)


def disaggregated(costs: Costs, load: Load, prefill_boards: int = 1, decode_boards: int = 1) -> Prediction:
    """Prefill boards run the prompts only; decode boards import each prompt's KV and run every stream."""
    service = costs.prefill_s(load.prompt)
    tt = ttft_met(service, load.rate / prefill_boards, load.slo_ttft_s)
    rate = load.rate / decode_boards
    stall = costs.import_s(load.prompt)
    if decode_interval(costs, rate, load.output, stall) is None:
        return Prediction(0.0, tt, 0.0, None, None, service, False)
    mean, p99, tp, _ = _tpot(costs, load, rate, stall, stall)  # its own import delays its second token
    stable = load.rate / prefill_boards * service < 1.0
    return Prediction(load.rate * tt * tp, tt, tp, mean, p99, service, stable)


def split_pays(costs: Costs, prompt: int) -> bool:
    """Does a hand-off cost the decode board less than computing the prompt there (a co-located run)?"""
    return costs.import_s(prompt) < costs.prefill_s(prompt)


def min_split_prompt(costs: Costs, longest: int = 1 << 17) -> int | None:
    """The shortest prompt from which every longer one is cheaper to import than to compute on the decode
    board (the balancer's `routing.pd_min_prompt_tokens`); None: importing never pays."""
    if not split_pays(costs, longest):
        return None
    lo, hi = 1, longest  # import_s - prefill_s falls with the prompt (per block: import < compute)
    while lo < hi:
        mid = (lo + hi) // 2
        if all(split_pays(costs, n) for n in range(mid, min(mid + costs.block_size, longest) + 1)):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _rates(top: float) -> list[float]:
    return [round(_GRID * i, 6) for i in range(1, int(top / _GRID) + 1)]


def break_rate(costs: Costs, load: Load, boards: int = 2, top: float = 50.0) -> float | None:
    """The lowest rate at which co-located TPOT P99 passes the SLO (the bench's break point); None: never
    below `top` (or the boards saturate first and TTFT, not TPOT, is what fails)."""
    if load.slo_tpot_s is None:
        return None
    for rate in _rates(top):
        p = colocated(costs, load.at(rate), boards)
        if p.tpot_p99_s is None or not p.stable:
            return None
        if p.tpot_p99_s > load.slo_tpot_s:
            return rate
    return None


def capacity(predict, load: Load, top: float = 50.0) -> tuple[float, float]:
    """(rate, goodput) at the rate with the most goodput for `predict(load)`: every 0.5 requests/s, then
    every 0.05 around the best of those."""
    def best_of(rates) -> tuple[float, float]:
        best = (0.0, 0.0)
        for rate in rates:
            g = predict(load.at(rate)).goodput
            if g > best[1]:
                best = (rate, g)
        return best

    coarse = best_of(_rates(top)[9::10])
    lo = max(coarse[0] - 0.5, 0.0)
    rate, good = max(coarse, best_of(r for r in _rates(coarse[0] + 0.5) if r > lo), key=lambda x: x[1])
    return rate, round(good, 3)


def min_winning_prompt(costs: Costs, load: Load, boards: int = 2, longest: int = 8192) -> int | None:
    """The shortest prompt (a multiple of the block size) from which the best prefill:decode split of
    `boards` has more goodput capacity than co-locating on them all; None: not up to `longest`. A
    bisection: the split's advantage grows with the prompt (more prefill per request to keep off the
    decode boards)."""
    def wins(prompt: int) -> bool:
        ld = Load(load.rate, prompt, load.output, load.slo_ttft_s, load.slo_tpot_s)
        co = capacity(lambda x: colocated(costs, x, boards), ld)[1]
        return any(capacity(lambda x, p=p: disaggregated(costs, x, p, boards - p), ld)[1] > co
                   for p in range(1, boards))

    bs = costs.block_size
    lo, hi = 1, max(longest // bs, 1)
    if not wins(hi * bs):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if wins(mid * bs):
            hi = mid
        else:
            lo = mid + 1
    return lo * bs


def compare(costs: Costs, load: Load, boards: int = 2) -> dict:
    """Co-located (all boards mixed) against every prefill:decode split of the boards at `load.rate`, the
    break point, and the goodput capacity of each: what `npuserve bench serve disagg` prints as bounds."""
    co = colocated(costs, load, boards)
    splits = {f"{p}:{boards - p}": disaggregated(costs, load, p, boards - p) for p in range(1, boards)}
    best = max(splits, key=lambda k: splits[k].goodput) if splits else None
    at = break_rate(costs, load, boards)
    out = {"rate": load.rate, "co_located": co.to_dict(), "splits": {k: v.to_dict() for k, v in splits.items()},
           "best_split": best, "ratio": _ratio(splits[best].goodput, co.goodput) if best else None,
           "break_rate": at, "min_split_prompt": min_split_prompt(costs)}
    if best:
        p = int(best.split(":")[0])
        if at is not None:
            c, d = colocated(costs, load.at(at), boards), disaggregated(costs, load.at(at), p, boards - p)
            out.update(ratio_at_break=_ratio(d.goodput, c.goodput),
                       bound_at_break=_ratio(at, c.goodput))  # every offered request meeting the SLO
        cap_co = capacity(lambda ld: colocated(costs, ld, boards), load)
        cap_d = capacity(lambda ld: disaggregated(costs, ld, p, boards - p), load)
        out.update(capacity_co_located=cap_co, capacity_split=cap_d, capacity_ratio=_ratio(cap_d[1], cap_co[1]),
                   min_winning_prompt=min_winning_prompt(costs, load, boards))
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None
