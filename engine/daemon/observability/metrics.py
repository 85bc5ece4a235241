"""Prometheus metrics of a board daemon: names and buckets mirror vLLM's (`vllm:` -> `npuserve:`).

Two kinds of figures, two ways across the thread boundary:

* Events (a request finished, a token was emitted, a job came back) are
  observed by the loop thread into prometheus_client Histograms and Counters.
  Those objects guard every value with their own lock, so the HTTP thread
  can read them while the loop observes: no scheduler object is shared.
* State (queue depths, KV blocks, chips) is read by the loop thread itself,
  every PUBLISH_INTERVAL_S, into an immutable `Snapshot` (tuples of frozen
  dataclasses) that replaces the previous one by a single reference
  assignment (atomic under the GIL). `SnapshotCollector.collect()`, run by
  the HTTP thread on a scrape, reads whichever snapshot is current and never
  touches the scheduler, the frontend or the supervisor.

Labels are bounded: model_name, chip, queue, kind, profile, state, reason
(codes from the core, a fixed set) and tenant only for tenants named in the
configuration (all others are summed as "other"). A request or job id never
becomes a label (unbounded label values grow a scraper's memory without
end); they go to traces (docs/observability.md).
"""

from __future__ import annotations

import errno
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.core.actions import EmitTokens, FailRequest, FinishRequest, SubmitJob
from engine.core.inflight_governor import DowngradeReason
from engine.core.stop_conditions import StopReason
from engine.daemon.constraint_cache import BOARD_CACHE
from engine.core.model_state import ModelState
from engine.daemon.observability import exposition
from engine.daemon.observability.chip_occupancy import ChipOccupancy
from engine.daemon.observability.kv_tier_metrics import tier_families
from engine.daemon.observability.lora_metrics import lora_families
from engine.daemon.observability.loop_histogram import LoopHistogram

if TYPE_CHECKING:
    from engine.daemon.generations import Generations
    from engine.daemon.views import Views
    from ipc.records import JobResult

PREFIX = "npuserve:"
PUBLISH_INTERVAL_S = 0.5  # how stale a scraped gauge may be; Prometheus scrapes every 15 s or so
IDLE_PUBLISH_INTERVAL_S = 5.0  # with nothing in flight and nothing new, rebuild this rarely (idle CPU)
MAX_TRACKED_JOBS = 4096  # job start times kept for latency; jobs whose result never comes age out

# vLLM v1's buckets (vllm/v1/metrics/loggers.py), so its dashboards and gateways read these as they are.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# npuserve's own: one chip job, from the loop handing it over to the loop seeing its result.
JOB_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                       2.5, 5.0, 10.0, 30.0)
# The idle gap of a chip between two backend calls (worker clock): tens of microseconds when the next job was
# already queued, the scheduler's turn when it was not, seconds when there was no work.
IDLE_GAP_BUCKETS = (0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 1.0, 5.0)
KV_BLOCK_STATES = ("free", "used", "evictable", "quarantined")  # a partition of every chip's blocks
ADMISSION_BLOCK_REASONS = ("kv", "max_sequences", "tenant_cap", "static_batching")  # Scheduler.admission_blocked
# Counters whose label values are a fixed set start at 0 for each value (Prometheus's advice), so a scrape stores
# every documented name from the start and a rate over them is 0, not absent, before the first event.
FINISH_REASONS = tuple(r.value for r in StopReason) + ("cancelled",)


class MetricsPortBusy(RuntimeError):
    """The configured metrics port cannot be bound."""


# -- the immutable snapshot -----------------------------------------------------------
@dataclass(frozen=True)
class Family:
    kind: str  # "gauge" | "counter" | "histogram" (a sample's value: ((le, count) per bucket, +Inf count, sum))
    name: str  # without PREFIX; a counter without its _total
    doc: str
    labels: tuple[str, ...]
    samples: tuple[tuple[tuple[str, ...], float], ...]


Snapshot = tuple[Family, ...]


class SnapshotCollector(Collector):
    """Turns the current snapshot into metric families; runs on the HTTP thread."""

    def __init__(self) -> None:
        self.snapshot: Snapshot = ()

    def collect(self) -> Iterator[Metric]:
        for f in self.snapshot:  # one read of the reference: a consistent snapshot
            if f.kind == "histogram":
                h = HistogramMetricFamily(PREFIX + f.name, f.doc, labels=f.labels)
                for values, (buckets, n_inf, total) in f.samples:
                    cum, rows = 0, []
                    for le, n in buckets:
                        cum += n
                        rows.append((repr(float(le)), cum))
                    rows.append(("+Inf", cum + n_inf))
                    h.add_metric(values, rows, total)
                yield h
                continue
            cls = GaugeMetricFamily if f.kind == "gauge" else CounterMetricFamily
            m = cls(PREFIX + f.name, f.doc, labels=f.labels)
            for values, v in f.samples:
                m.add_metric(values, v)
            yield m


class _Builder:
    """Collects the families of one snapshot (loop thread)."""

    def __init__(self, model: str, generation: int | None = None) -> None:
        """`generation`: label every row with it too (the figures of one model generation)."""
        self.head: tuple[str, ...] = (model,) if generation is None else (model, str(generation))
        self.head_labels = ("model_name",) if generation is None else ("model_name", "generation")
        self.families: list[Family] = []

    def add(self, kind: str, name: str, doc: str, labels: tuple[str, ...],
            samples: Iterable[tuple[tuple[str, ...], float]]) -> None:
        rows = tuple(((*self.head, *vals), v if kind == "histogram" else float(v)) for vals, v in samples
                     if v is not None)
        self.families.append(Family(kind, name, doc, (*self.head_labels, *labels), rows))

    def one(self, kind: str, name: str, doc: str, value: float) -> None:
        self.add(kind, name, doc, (), [((), value)])


def build_snapshot(v: "Views", now: float, bounded_tenants: frozenset[str]) -> Snapshot:
    """Read the board's state into plain immutable families, per model generation. Loop thread only."""
    merged: dict[str, Family] = {}

    def merge(families: list[Family]) -> None:
        for f in families:
            old = merged.get(f.name)
            merged[f.name] = f if old is None else Family(f.kind, f.name, f.doc, f.labels, old.samples + f.samples)

    gens = v.gens
    for g in sorted(gens.serving_generations(), key=lambda g: g.id):
        b = _Builder(g.alias, g.id)
        chips = g.chips_info(now)
        _generation_families(b, g.scheduler.stats(now), chips, bounded_tenants)
        piece_cache_families(b, g.piece_cache_stats())
        ring_layout_families(b, chips)
        merge(b.families)
    b = _Builder(gens.model_alias)
    b.one("gauge", "loop_lag_seconds", "Longest recent turn of the scheduler loop.", v.liveness.lag_s(now))
    b.one("counter", "loop_turns", "Turns of the scheduler loop.", v.liveness.turns)
    b.one("gauge", "accepting", "1 while the daemon accepts new requests.", 1 if gens.accepting else 0)
    constraint_families(b)
    heap_trim_families(b, v.heap_trim.stats() if v.heap_trim is not None else None)
    if gens.lora.loads:
        lora_families(b, gens.lora.stats())
    merge(b.families)
    merge(_lifecycle_families(gens))
    return tuple(merged.values())


def piece_cache_families(b: _Builder, pc: dict | None) -> None:
    """The generation's token-bytes cache (model.piece_cache_entries): its size against the bound, hits, misses."""
    if pc is None:
        return
    b.one("gauge", "piece_cache_entries", "Token ids whose text bytes the daemon caches (at most "
          "model.piece_cache_entries).", pc["entries"])
    b.add("counter", "piece_cache_lookups", "Lookups of a generated token's text bytes, by result.", ("result",),
          [(("hit",), pc["hits"]), (("miss",), pc["misses"])])


def ring_layout_families(b: _Builder, chips: list[dict]) -> None:
    """The daemon's ends of each chip's rings (board.ring_layout_cache_entries): cached record shapes, lookups."""
    rows = [(str(c["chip"]), ring, st) for c in chips if c.get("ring_layouts") for ring, st in c["ring_layouts"].items()]
    if not rows:
        return
    b.add("gauge", "ring_layout_cache_entries", "Record shapes whose layout the daemon keeps for a chip's ring "
          "(at most board.ring_layout_cache_entries).", ("chip", "ring"), [((c, r), st["entries"]) for c, r, st in rows])
    b.add("counter", "ring_layout_lookups", "Lookups of a record's layout at the daemon's end of a chip's ring, by "
          "result.", ("chip", "ring", "result"),
          [((c, r, res), st[k]) for c, r, st in rows for res, k in (("hit", "hits"), ("miss", "misses"))])


def heap_trim_families(b: _Builder, ht: dict | None) -> None:
    """The daemon's malloc_trim (board.malloc_trim_interval_s): how often it ran and the RSS it gave back."""
    if ht is None or not ht["available"] or ht["interval_s"] <= 0:
        return
    b.one("counter", "malloc_trims", "Times the daemon gave glibc's free heap pages back to the kernel.", ht["trims"])
    b.one("counter", "malloc_trim_released_bytes", "Anonymous RSS the daemon's malloc_trim calls gave back.",
          ht["released_bytes"])


def constraint_families(b: _Builder) -> None:
    """Structured output at admission: constrained requests, refusals, compiles and their time (the board's)."""
    c = BOARD_CACHE.stats()
    b.one("counter", "constrained_requests", "Requests admitted with an output constraint (structured output).",
          c["compiles"] + c["hits"])
    b.one("counter", "constraint_rejected", "Requests refused because their constraint does not compile.",
          c["rejected"])
    b.one("counter", "constraint_compiles", "Constraints compiled at admission (a repeated one is cached).",
          c["compiles"])
    b.one("counter", "constraint_compile_seconds", "Time spent compiling constraints at admission.",
          c["compile_s_total"])


def _lifecycle_families(gens: "Generations") -> list[Family]:
    """Model generations by state, their requests, and the loads and unloads so far (docs/observability.md)."""
    recs = sorted(gens.models.generations.values(), key=lambda r: r.id)
    fams = [Family("gauge", "model_generation_state", "1 for the lifecycle state each model generation is in.",
                   ("model_name", "generation", "state"),
                   tuple(((r.alias, str(r.id), st.value), 1.0 if r.state is st else 0.0)
                         for r in recs for st in ModelState)),
            Family("gauge", "model_active_requests", "Requests pinned to each model generation, in flight.",
                   ("model_name", "generation"), tuple(((r.alias, str(r.id)), float(r.active_requests))
                                                       for r in recs)),
            Family("counter", "model_requests", "Requests each model generation took, by outcome "
                   "(completed, failed, rejected at submit).", ("model_name", "generation", "outcome"),
                   tuple(((r.alias, str(r.id), k), float(r.counters.get(k, 0)))
                         for r in recs for k in ("completed", "failed", "rejected")))]
    fams.append(Family("counter", "model_lifecycle_ops", "Loads (and replaces, rollbacks) and unloads, by outcome.",
                       ("model_name", "op", "outcome"),
                       tuple(((alias, op, outcome), float(n)) for (alias, op, outcome), n in
                             sorted(gens.lifecycle_counts.items()))))
    return fams


def _spec_families(b: _Builder, sp: dict | None) -> None:
    """Speculative decoding, under vLLM's spec_decode_* names (engine.core.spec.planner.SpecCounters)."""
    if not sp:
        return
    b.one("counter", "spec_decode_num_drafts", "Verification steps: lanes that carried draft tokens.",
          sp["num_drafts"])
    b.one("counter", "spec_decode_num_draft_tokens", "Draft tokens proposed.", sp["num_draft_tokens"])
    b.one("counter", "spec_decode_num_accepted_tokens", "Draft tokens accepted.", sp["num_accepted_tokens"])
    b.one("counter", "spec_decode_num_emitted_tokens", "Tokens produced by verification steps (accepted drafts "
          "plus the token after them): tokens per step = this / spec_decode_num_drafts.", sp["num_emitted_tokens"])
    b.add("counter", "spec_decode_num_accepted_tokens_per_pos", "Steps whose draft at this position was accepted.",
          ("position",), [((str(i),), n) for i, n in enumerate(sp["accepted_per_pos"])])
    buckets = sp["acceptance_rate_buckets"]
    cum = [sum(buckets[:i + 1]) for i in range(len(buckets))]
    les = [f"{(i + 1) / 10:.1f}" for i in range(len(buckets) - 1)] + ["+Inf"]
    b.add("counter", "spec_decode_acceptance_rate_steps", "Verification steps by acceptance rate "
          "(accepted / drafted), cumulative as histogram buckets: le=0.1 holds the steps below 0.1, "
          "+Inf all of them (1.0 falls only in +Inf).", ("le",), [((le,), n) for le, n in zip(les, cum)])


def _generation_families(b: _Builder, st: dict, chips: list[dict], bounded_tenants: frozenset[str]) -> None:
    """The scheduler, KV, queue, batch and chip figures of one generation."""
    counters = st["counters"]
    b.one("gauge", "num_requests_running", "Requests admitted: holding KV, prefilling or decoding.",
          st["active_sequences"])
    b.one("gauge", "num_requests_waiting", "Requests waiting for admission.", st["waiting_requests"])
    b.one("gauge", "num_waiting_prompt_tokens", "Prompt tokens of the requests waiting for admission.",
          st["waiting_prompt_tokens"])
    total = used = 0
    kv_blocks, kv_seqs = [], []
    for chip, c in st["chips"].items():
        blocks = c["kv"]["blocks"]
        total += blocks["total"]
        used += blocks["used"] + blocks["quarantined"]
        kv_blocks += [((chip, s), blocks[s]) for s in KV_BLOCK_STATES]
        kv_seqs += [((chip, s), n) for s, n in c["kv"]["sequences"].items()]
    b.one("gauge", "kv_cache_usage_perc", "KV-cache usage of the board. 1 means 100 percent usage "
          "(blocks held by sequences or quarantined; cached but unreferenced blocks count as free).",
          used / total if total else 0.0)
    b.add("gauge", "kv_blocks", "KV blocks by state; the states partition each chip's pool.",
          ("chip", "state"), kv_blocks)
    b.add("gauge", "kv_sequences", "KV sequences by state.", ("chip", "state"), kv_seqs)
    b.add("gauge", "jobs_inflight", "Jobs handed to the chip and not answered yet.", ("chip",),
          [((chip, ), c["inflight"]) for chip, c in st["chips"].items()])
    b.add("gauge", "queued_steps_inflight", "Decode lanes whose next step is queued behind their running job "
          "(executor.queue_next_step); those steps are jobs among jobs_inflight.", ("chip",),
          [((chip, ), c["queued_steps_inflight"]) for chip, c in st["chips"].items()])
    b.one("counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
          counters.get("prefix_query_tokens", 0))
    b.one("counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
          counters.get("prefix_hit_tokens", 0))
    b.one("counter", "prompt_tokens", "Prompt tokens of requests that sampled their first token.",
          counters["prompt_tokens"])
    b.one("counter", "generation_tokens", "Tokens sampled.", counters["generation_tokens"])
    b.one("counter", "num_preemptions", "Sequences preempted (KV released, recomputed later).",
          counters.get("preemptions", 0))
    _spec_families(b, st.get("speculative"))
    # admission
    b.one("counter", "requests_accepted", "Requests accepted into the waiting queue.", counters.get("accepted", 0))
    b.one("counter", "requests_admitted", "Admissions to a chip (KV reserved); a requeued request counts again.",
          counters.get("admitted", 0))
    b.add("counter", "requests_rejected", "Requests refused at submit, by reason (400/429/503).", ("reason",),
          [((k[len("rejected_"):],), v) for k, v in sorted(counters.items()) if k.startswith("rejected_")])
    # queues
    qd, qw = [], []
    for chip, queues in st["queue_waits"].items():
        for q, e in queues.items():
            qd.append(((chip, q), e["depth"]))
            qw.append(((chip, q), e["oldest_wait_s"]))
    blocked = st["admission_blocked"]
    b.add("gauge", "admission_blocked", "1 for the reason the head of the waiting queue was not admitted at "
          "the last tick (kv, max_sequences, tenant_cap, static_batching); all 0 when nobody waits.",
          ("reason",), [((r,), 1 if blocked == r else 0) for r in ADMISSION_BLOCK_REASONS])
    b.add("gauge", "queue_depth", "Requests in each queue: admission (chip=\"board\"), decode and the "
          "short/medium/long prefill classes per chip.", ("chip", "queue"), qd)
    b.add("gauge", "queue_oldest_wait_seconds", "How long the oldest request of each queue has waited.",
          ("chip", "queue"), qw)
    # batches
    prof = st["decode_profiles"]
    b.add("counter", "decode_jobs", "Decode jobs by compiled batch profile.", ("profile",),
          [((str(p),), e["jobs"]) for p, e in prof.items()])
    b.add("counter", "decode_lanes", "Active lanes of decode jobs by profile.", ("profile",),
          [((str(p),), e["lanes"]) for p, e in prof.items()])
    b.add("counter", "decode_lane_waste", "Inactive (masked) lanes of decode jobs by profile.", ("profile",),
          [((str(p),), e["lane_waste"]) for p, e in prof.items()])
    b.add("gauge", "batch_fill_ratio", "Active lanes / lane slots of the decode jobs so far, by profile.",
          ("profile",), [((str(p),), e["fill_ratio"]) for p, e in prof.items()])
    # chips and workers
    b.add("gauge", "chip_up", "1 when the chip's worker is in service.", ("chip",),
          [((str(c["chip"]),), 1 if c["state"] == "up" else 0) for c in chips])
    b.add("counter", "worker_restarts", "Worker processes restarted after a failure.", ("chip",),
          [((str(c["chip"]),), c["restarts_total"]) for c in chips])
    b.add("counter", "inflight_downgrades", "Chips dropped from ping/pong to one job in flight, by reason "
          "(crosstalk, status_anomaly, repeated_timeouts, tpot_regression).", ("reason",),
          [((r.value,), counters.get(f"inflight_downgrades_{r.value}", 0)) for r in DowngradeReason])
    b.add("gauge", "inflight_limit", "Jobs a chip may hold in flight now (executor.max_inflight, or 1 after a "
          "downgrade).", ("chip",), [((chip,), c["inflight_governor"]["limit"]) for chip, c in st["chips"].items()
                                     if "inflight_governor" in c])
    b.add("counter", "chip_device_seconds", "Time the chip backend calls took.", ("chip",),
          [((str(c["chip"]),), c["device_s"]) for c in chips])
    # fairness, for the tenants the configuration names
    service: dict[str, float] = {}
    for t, n in st["tenant_service_tokens"].items():
        key = t if t in bounded_tenants else "other"
        service[key] = service.get(key, 0) + n
    b.add("counter", "tenant_service_tokens", "Tokens computed per tenant (configured tenants; others as "
          "\"other\").", ("tenant",), [((t,), n) for t, n in sorted(service.items())])
    if "kv_tiers" in st:
        tier_families(b, st["kv_tiers"])


# -- the recorder (loop thread) ------------------------------------------------------------
@dataclass(frozen=True)
class _ModelSeries:
    """The latency histograms' children of one model alias."""

    ttft: object
    itl: object
    e2e: object
    queue: object



class MetricsRecorder:
    """Observes the loop's actions and job results; publishes snapshots; optionally serves HTTP."""

    def __init__(self, model: str, bounded_tenants: Iterable[str] = ()) -> None:
        disable_created_metrics()  # the *_created series only add noise to every scrape
        self.model = model
        self.bounded_tenants = frozenset(bounded_tenants)
        self.registry = CollectorRegistry()
        self.collector = SnapshotCollector()
        self.registry.register(self.collector)
        r, m = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        # observed per generated token: a lock-free loop-thread histogram (loop_histogram.py)
        self.itl = LoopHistogram(PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in "
                                 "seconds.", m, ITL_BUCKETS, r)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Histogram of time spent waiting for the first job "
                          "(seconds).", REQUEST_LATENCY_BUCKETS)
        self.success = Counter(PREFIX + "request_success", "Count of successfully processed requests "
                               "(a terminal `done` event), by finish reason.", ["model_name", "finished_reason"],
                               registry=r)
        self.failure = Counter(PREFIX + "request_failure", "Accepted requests that ended with an error event, "
                               "by reason.", ["model_name", "reason"], registry=r)
        self.job_latency = Histogram(PREFIX + "job_latency_seconds", "Chip jobs from hand-over to result, as "
                                     "the scheduler loop sees them, by chip and kind.",
                                     ["model_name", "chip", "kind"], buckets=JOB_LATENCY_BUCKETS, registry=r)
        self.constraint_masks = Counter(PREFIX + "constraint_masks", "Token masks computed for constrained "
                                        "lanes (structured output), one per lane and step.", m, registry=r)
        self.constraint_mask_seconds = Counter(PREFIX + "constraint_mask_seconds", "Worker time spent computing "
                                               "those masks.", m, registry=r)
        self._job_children: dict[tuple[str, int, str], object] = {}
        self.idle_gap = Histogram(PREFIX + "chip_idle_gap_seconds", "Time a chip sat idle between the end of one "
                                  "backend call and the start of the next (the worker's clock), by chip.",
                                  ["model_name", "chip"], buckets=IDLE_GAP_BUCKETS, registry=r)
        self._gap_children: dict[tuple[str, int], object] = {}
        self.occupancy = ChipOccupancy()
        self._success_children: dict[tuple[str, str], object] = {}
        self._series: dict[str, _ModelSeries] = {}  # model alias -> its histogram children
        self.series(model)  # the default model's histograms exist (empty) from the first scrape
        self._last_emit: dict[int, float] = {}  # request id -> time of its last tokens (loop thread only)
        # (generation, job id) -> (submitted, chip, kind, model alias)
        self._job_start: dict[tuple[int, int], tuple[float, int, str, str]] = {}
        self.next_publish = 0.0
        self._last_activity: tuple | None = None  # what had happened at the last publish (see `publish`)
        self._next_idle_publish = 0.0
        self._http: exposition.MetricsHttp | None = None

    # -- HTTP --------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> None:
        """Start the /metrics HTTP server (a thread; text or OpenMetrics, same names). Raises MetricsPortBusy."""
        try:
            self._http = exposition.serve(host, port, [self.registry])
        except OSError as e:
            why = "is in use by another process" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror}"
            raise MetricsPortBusy(f"metrics port {host}:{port} {why}; choose another with --metrics-port "
                                  f"or metrics.port (0 turns metrics serving off)") from None

    @property
    def port(self) -> int | None:
        return None if self._http is None else self._http.port

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    # -- loop-thread hooks -----------------------------------------------------------------
    def series(self, alias: str) -> "_ModelSeries":
        s = self._series.get(alias)
        if s is None:
            s = self._series[alias] = _ModelSeries(self.ttft.labels(alias), self.itl.labels(alias),
                                                   self.e2e.labels(alias), self.queue.labels(alias))
            for reason in FINISH_REASONS:  # each model's counters exist (at 0) from its first scrape
                self.success.labels(alias, reason)
            self.constraint_masks.labels(alias)
            self.constraint_mask_seconds.labels(alias)
        return s

    def on_actions(self, actions: list, now: float, generation: int = 0, alias: str | None = None) -> None:
        """`alias`: the model the actions' requests run on (metric label model_name); None = the default."""
        alias = alias or self.model
        ser = None
        last_emit = self._last_emit
        intervals: list[float] = []  # this call's inter-token latencies (one `now` for all of them)
        for a in actions:
            t = type(a)
            if t is EmitTokens:
                rid = a.request_id
                prev = last_emit.get(rid)
                if prev is not None:
                    intervals.append(now - prev)
                last_emit[rid] = now
            elif t is SubmitJob:
                jobs = self._job_start
                if len(jobs) >= MAX_TRACKED_JOBS:
                    del jobs[next(iter(jobs))]
                jobs[(generation, a.job.job_id)] = (now, a.chip, a.job.kind.name.lower(), alias)
            elif t is FinishRequest:
                last_emit.pop(a.request_id, None)
                self._finished(ser or (ser := self.series(alias)), alias, a.finish_reason, a.timing)
            elif t is FailRequest:
                last_emit.pop(a.request_id, None)
                if a.timing is not None:  # accepted, then failed (a rejection is counted by the core)
                    self.failure.labels(alias, a.reason).inc()
        if intervals:
            (ser or self.series(alias)).itl.observe_many(intervals)

    def _finished(self, ser: "_ModelSeries", alias: str, reason: str, timing: dict) -> None:
        child = self._success_children.get((alias, reason))
        if child is None:
            child = self._success_children[(alias, reason)] = self.success.labels(alias, reason)
        child.inc()
        e2e = timing.get("e2e_ms")
        if e2e is not None:
            ser.e2e.observe(e2e / 1000.0)
        ttft = timing.get("ttft_ms")
        if ttft is not None:
            ser.ttft.observe(ttft / 1000.0)
        q = timing.get("queue_ms")
        if q is not None:
            ser.queue.observe(q / 1000.0)

    def on_result(self, chip: int, result: "JobResult", now: float, generation: int = 0) -> None:
        start = self._job_start.pop((generation, result.job_id), None)
        if start is None or start[1] != chip:
            return
        gap_key = (start[3], chip)
        self.occupancy.observe(gap_key, result.device_us)
        if result.idle_us >= 0:
            gap = self._gap_children.get(gap_key)
            if gap is None:
                gap = self._gap_children[gap_key] = self.idle_gap.labels(start[3], str(chip))
            gap.observe(result.idle_us / 1e6)
        if result.masks:
            self.constraint_masks.labels(start[3]).inc(result.masks)
            self.constraint_mask_seconds.labels(start[3]).inc(result.mask_us / 1e6)
        key = (start[3], chip, start[2])
        child = self._job_children.get(key)
        if child is None:
            child = self._job_children[key] = self.job_latency.labels(start[3], str(chip), start[2])
        child.observe(now - start[0])

    def on_chip_down(self, chip: int, generation: int = 0) -> None:
        for job_id in [j for j, s in self._job_start.items() if s[1] == chip and j[0] == generation]:
            del self._job_start[job_id]

    def publish(self, v: "Views", now: float, force: bool = False) -> None:
        """Swap in a fresh snapshot (at most every PUBLISH_INTERVAL_S unless forced)."""
        if now < self.next_publish and not force:
            return
        self.next_publish = now + PUBLISH_INTERVAL_S
        # An idle board changes nothing a gauge shows: skip the rebuild (it is most of an idle daemon's CPU
        # turn) until something happened or the idle interval passed (uptime-like figures stay fresh enough).
        fc, dc = v.frontend.counters, v.board_counters()
        activity = (fc.messages_in, dc["results"], dc["chip_failures"], dc["worker_restarts"],
                    v.frontend.active(), tuple((g.id, g.rec.state, tuple(g.chips_info(now)[c]["state"]
                                                                         for c in range(len(g.links))))
                                               for g in v.gens.serving_generations()))
        if not force and activity == self._last_activity and activity[4] == 0 and now < self._next_idle_publish:
            return
        self._last_activity = activity
        self._next_idle_publish = now + IDLE_PUBLISH_INTERVAL_S
        busy = self.occupancy.window(now)
        self.collector.snapshot = build_snapshot(v, now, self.bounded_tenants) + (
            Family("gauge", "chip_busy_fraction", "Device time / wall time of each chip over the last publish "
                   "window (about 0.5 s while busy): below 1 while work waits, the chip waited on the host.",
                   ("model_name", "chip"), tuple(((m, str(c)), f) for (m, c), f in sorted(busy.items()))),)

    # -- for the stats op ------------------------------------------------------------------
    def families(self) -> list[dict]:
        """Every metric family as plain data: what /metrics would show now (loop thread)."""
        out = []
        for m in self.registry.collect():
            out.append({"name": m.name, "type": m.type, "help": m.documentation,
                        "samples": [[s.name, dict(s.labels), s.value] for s in m.samples
                                    if not s.name.endswith("_created")]})
        return out
