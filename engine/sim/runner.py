"""The in-process simulator: the real Scheduler against virtual chips and a virtual clock.

Clients are a closed loop: `concurrency` requests are outstanding at once and
each completion immediately sends the next one, which is how `bench-serve`
drives a daemon.  Nothing sleeps: time jumps to the next job completion or
scheduler wake-up, so minutes of serving simulate in about a second.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import asdict, dataclass, field

from engine.core.actions import EmitTokens, FailRequest, FinishRequest, SubmitJob
from engine.core.requests import GenerateParams
from engine.core.scheduler import ChipSpec, ModelSpec, Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.sim.virtual_chip import VirtualChip
from engine.sim.workload import SimRequest, make_workload
from workers.backends.sim_latency import LatencyModel

POLICIES = ("continuous", "continuous-nochunk", "static", "serial")

# The `sim` backend's defaults (workers/backends/stub.py): what a daemon with backend = "sim" declares.
SIM_PROFILES = (1, 4, 8, 16)
SIM_MAX_SEQ = 2048
SIM_NUM_BLOCKS = 4096
SIM_BLOCK_SIZE = 16
SIM_VOCAB = 32000


@dataclass
class SimResult:
    policy: str
    concurrency: int
    requests: int
    throughput_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    itl_p99_ms: float  # inter-token latency P99: the stall a long prefill causes shows here
    makespan_s: float
    chip_busy: float  # fraction of the makespan the chips were computing
    # Per chip: busy_s, decode_jobs, decode_lanes, prefill_jobs, prefill_tokens (VirtualChip.summary):
    # what bench-serve compares a daemon's run with, to tell job-mix differences from idle time.
    per_chip: list[dict] = field(default_factory=list)

    def row(self) -> dict:
        def r(v):
            if isinstance(v, float):
                return round(v, 2)
            if isinstance(v, list):
                return [{k: r(x) for k, x in d.items()} for d in v]
            return v

        return {k: r(v) for k, v in asdict(self).items()}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def policy_config(policy: str, profiles: tuple[int, ...], base: SchedulerConfig | None = None) -> SchedulerConfig:
    from dataclasses import replace

    base = base or SchedulerConfig()
    big = dict(max_waiting_requests=100_000, max_waiting_prompt_tokens=10**9, default_deadline_s=None)
    if policy == "continuous":
        return replace(base, **big)
    if policy == "continuous-nochunk":
        return replace(base, chunked_prefill=False, **big)
    if policy == "static":
        return replace(base, static_batching=True, max_sequences=max(profiles), **big)
    if policy == "serial":
        return replace(base, static_batching=True, max_sequences=1, **big)
    raise ValueError(f"unknown policy {policy!r} (one of {POLICIES})")


def simulate(policy: str, concurrency: int, workload: list[SimRequest], *, chips: int = 1,
             latency: LatencyModel | None = None, profiles: tuple[int, ...] = SIM_PROFILES,
             max_seq: int = SIM_MAX_SEQ, num_blocks: int = SIM_NUM_BLOCKS, block_size: int = SIM_BLOCK_SIZE,
             config: SchedulerConfig | None = None, trace: dict | None = None) -> SimResult:
    """Serve `workload` with at most `concurrency` requests outstanding; returns its figures (`SimResult`).

    `trace`, when given, receives per-request {index: (arrival, first_token, done)} times.
    """
    assert concurrency >= 1 and workload
    latency = latency or LatencyModel()
    model = ModelSpec(generation=1, vocab_size=SIM_VOCAB, eos_ids=(0,), max_seq=max_seq,
                      profiles=tuple(profiles), chunked_prefill=True)
    sched = Scheduler(policy_config(policy, tuple(profiles), config), model,
                      [ChipSpec(c, num_blocks, block_size) for c in range(chips)])
    vchips = {c: VirtualChip(c, latency, SIM_VOCAB) for c in range(chips)}
    events: list[tuple[float, int, int, object]] = []
    order = itertools.count()
    arrival: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    ntok: dict[int, int] = {}
    ttft: list[float] = []
    tpot: list[float] = []
    gaps: list[float] = []
    total_tokens = 0
    done = 0
    next_req = 0
    now = 0.0

    def send(now: float) -> list:
        nonlocal next_req
        r = workload[next_req]
        next_req += 1
        arrival[r.index] = now
        p = GenerateParams(prompt=r.prompt, max_tokens=r.max_tokens, seed=r.index, ignore_eos=True)
        return sched.submit(r.index, p, now)

    def handle(actions: list, now: float) -> None:
        nonlocal total_tokens, done
        queue = list(actions)
        while queue:
            a = queue.pop(0)
            if isinstance(a, SubmitJob):
                t_done, result = vchips[a.chip].run(a.job, now)
                heapq.heappush(events, (t_done, next(order), a.chip, result))
            elif isinstance(a, EmitTokens):
                rid = a.request_id
                if rid not in first:
                    first[rid] = now
                    ttft.append((now - arrival[rid]) * 1000.0)
                else:
                    gaps.append((now - last[rid]) * 1000.0)
                last[rid] = now
                ntok[rid] = ntok.get(rid, 0) + len(a.tokens)
                total_tokens += len(a.tokens)
            elif isinstance(a, (FinishRequest, FailRequest)):
                if isinstance(a, FailRequest):
                    raise RuntimeError(f"simulated request {a.request_id} failed: {a.code} {a.reason}")
                rid = a.request_id
                done += 1
                if trace is not None:
                    trace[rid] = (arrival[rid], first.get(rid, now), now)
                if ntok.get(rid, 0) > 1:
                    tpot.append((last[rid] - first[rid]) * 1000.0 / (ntok[rid] - 1))
                if next_req < len(workload):
                    queue.extend(send(now))

    for _ in range(min(concurrency, len(workload))):
        handle(send(0.0), 0.0)
    while done < len(workload):
        handle(sched.tick(now), now)
        wake = sched.next_wakeup(now)
        t_next = events[0][0] if events else None
        if t_next is None and wake is None:
            raise RuntimeError("simulation stalled: no job in flight and nothing scheduled")
        if t_next is not None and (wake is None or t_next <= wake):
            now = t_next
            while events and events[0][0] <= now:
                _, _, chip, result = heapq.heappop(events)
                handle(sched.on_result(chip, result, now), now)
        else:
            now = max(now, wake)
    makespan = max(now, 1e-9)
    busy = sum(v.busy_time for v in vchips.values()) / (makespan * chips)
    return SimResult(
        policy=policy, concurrency=concurrency, requests=len(workload),
        throughput_tok_s=total_tokens / makespan,
        ttft_p50_ms=_pct(ttft, 0.50), ttft_p99_ms=_pct(ttft, 0.99),
        tpot_mean_ms=sum(tpot) / len(tpot) if tpot else 0.0, itl_p99_ms=_pct(gaps, 0.99),
        makespan_s=makespan, chip_busy=busy, per_chip=[vchips[c].summary() for c in sorted(vchips)],
    )


def serial_table(concurrencies: list[int], workload: list[SimRequest], **kw) -> list[SimResult]:
    """Serial (one request at a time) rows for every concurrency from ONE scheduler run.

    A one-at-a-time FIFO server with at least one request outstanding is never
    idle, so every request's service time and time-to-first-token-after-start
    are the same whatever the client concurrency; only arrival times move
    (request i arrives when request i-C completes).  Running the real
    scheduler once at concurrency 1 and replaying those times for each cap is
    exact, and 6x cheaper than re-simulating 30k single-lane decode steps.
    """
    trace: dict[int, tuple[float, float, float]] = {}
    base = simulate("serial", 1, workload, trace=trace, **kw)
    order = [r.index for r in workload]
    service = [trace[i][2] - trace[i][0] for i in order]
    to_first = [trace[i][1] - trace[i][0] for i in order]
    out = []
    for c in concurrencies:
        done: list[float] = []
        ttft: list[float] = []
        t = 0.0
        for k in range(len(order)):
            arrival = 0.0 if k < c else done[k - c]
            ttft.append((t + to_first[k] - arrival) * 1000.0)
            t += service[k]
            done.append(t)
        out.append(SimResult(
            policy="serial", concurrency=c, requests=len(workload), throughput_tok_s=base.throughput_tok_s,
            ttft_p50_ms=_pct(ttft, 0.50), ttft_p99_ms=_pct(ttft, 0.99), tpot_mean_ms=base.tpot_mean_ms,
            itl_p99_ms=base.itl_p99_ms, makespan_s=base.makespan_s, chip_busy=base.chip_busy,
            per_chip=base.per_chip,
        ))
    return out


def predict(concurrency: int, *, requests: int = 120, prompt_mean: int = 1024, gen_mean: int = 256,
            chips: int = 1, policy: str = "continuous", latency: LatencyModel | None = None,
            profiles: tuple[int, ...] = SIM_PROFILES, max_seq: int = SIM_MAX_SEQ,
            num_blocks: int = SIM_NUM_BLOCKS, block_size: int = SIM_BLOCK_SIZE,
            config: SchedulerConfig | None = None, seed: int = 42) -> SimResult:
    """Predicted serving metrics (tokens/s, TTFT, TPOT) of a closed-loop workload on sim chips."""
    wl = make_workload(requests, prompt_mean, gen_mean, max_seq=max_seq, seed=seed)
    return simulate(policy, concurrency, wl, chips=chips, latency=latency, profiles=profiles,
                    max_seq=max_seq, num_blocks=num_blocks, block_size=block_size, config=config)
