"""The daemon's metrics as a table for a human: what `npuserve stats` prints and `npuserve top` refreshes.

Reads the `metrics` section of a `stats` reply: the same metric families that
/metrics exposes (engine/daemon/observability/metrics.py), so the table and Prometheus never
disagree. Quantiles are estimated from histogram buckets the way Prometheus'
`histogram_quantile` does (linear within a bucket).
"""

from __future__ import annotations

import math
from collections import defaultdict

P = "npuserve:"


class Figures:
    """Sample lookup over the families of one stats reply."""

    def __init__(self, families: list[dict]) -> None:
        self.samples: dict[str, list[tuple[dict, float]]] = defaultdict(list)
        for f in families:
            for name, labels, value in f["samples"]:
                self.samples[name].append((labels, value))

    def total(self, name: str, **match: str) -> float:
        return sum(v for labels, v in self.samples.get(P + name, ())
                   if all(labels.get(k) == want for k, want in match.items()))

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for labels, v in self.samples.get(P + name, ()):
            if all(labels.get(k) == want for k, want in match.items()):
                out[labels.get(label, "")] += v
        return dict(out)

    def quantile(self, name: str, q: float, **match: str) -> float | None:
        """histogram_quantile(q, name) over the matching series; None without observations.

        Negative when the quantile falls in the first bucket: -bound means "below bound" (interpolating
        from 0 there would invent a value)."""
        buckets: dict[float, float] = defaultdict(float)
        for labels, v in self.samples.get(P + name + "_bucket", ()):
            if all(labels.get(k) == want for k, want in match.items()):
                buckets[float(labels["le"])] += v
        if not buckets:
            return None
        bounds = sorted(buckets)
        count = buckets[bounds[-1]]
        if count <= 0:
            return None
        rank = q * count
        lower, below = 0.0, 0.0
        for b in bounds:
            c = buckets[b]
            if c >= rank:
                if math.isinf(b):
                    return lower  # above the last finite bucket: its bound is all we know
                if below == 0 and lower == 0.0:
                    return -b
                return lower + (b - lower) * ((rank - below) / (c - below) if c > below else 0.0)
            lower, below = b, c
        return lower


def _num(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.{digits}f}"


def _secs(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 0:
        return "< " + _secs(-v)
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: indent + "  ".join(str(x).rjust(w) if i else str(x).ljust(w)  # noqa: E731
                                       for i, (x, w) in enumerate(zip(r, widths)))
    return [fmt(header)] + [fmt(r) for r in rows]


def render(stats: dict, previous: tuple[float, dict] | None = None, now: float | None = None) -> str:
    """The dashboard. With `previous` = (time, stats) of an earlier reply, rates per second are added."""
    f = Figures(stats.get("metrics", []))
    prev = Figures(previous[1].get("metrics", [])) if previous else None
    dt = (now - previous[0]) if previous and now is not None else None

    def rate(name: str) -> str:
        if prev is None or not dt or dt <= 0:
            return ""
        return f" ({(f.total(name) - prev.total(name)) / dt:.1f}/s)"

    up = stats.get("uptime_s")
    acc = "accepting" if f.total("accepting") else "NOT accepting"
    lines = [f"npuserve · uptime {_num(up, 1)} s · {acc}", ""]
    success = f.by("request_success_total", "finished_reason")
    failed = f.by("request_failure_total", "reason")
    rejected = f.by("requests_rejected_total", "reason")

    def detail(d: dict[str, float]) -> str:
        seen = sorted((k, v) for k, v in d.items() if v)  # reasons at 0 (exported from the start) say nothing
        return "" if not seen else " (" + ", ".join(f"{k} {_num(v)}" for k, v in seen) + ")"

    blocked = [r for r, v in f.by("admission_blocked", "reason").items() if v]
    why = f" (held by {blocked[0]})" if blocked else ""
    lines.append(f"requests   running {_num(f.total('num_requests_running'))}   waiting "
                 f"{_num(f.total('num_requests_waiting'))}{why}   accepted {_num(f.total('requests_accepted_total'))}"
                 f"{rate('requests_accepted_total')}")
    lines.append(f"           success {_num(sum(success.values()))}{detail(success)}   failed "
                 f"{_num(sum(failed.values()))}{detail(failed)}   rejected {_num(sum(rejected.values()))}"
                 f"{detail(rejected)}")
    queried = f.total("prefix_cache_queries_total")
    hit = f"{100 * f.total('prefix_cache_hits_total') / queried:.1f} %" if queried else "-"
    lines.append(f"tokens     prompt {_num(f.total('prompt_tokens_total'))}{rate('prompt_tokens_total')}   "
                 f"generated {_num(f.total('generation_tokens_total'))}{rate('generation_tokens_total')}   "
                 f"prefix-cache hits {hit}   preemptions {_num(f.total('num_preemptions_total'))}")
    lines += ["", "latency"]
    rows = []
    for label, name in (("time to first token", "time_to_first_token_seconds"),
                        ("inter-token", "inter_token_latency_seconds"),
                        ("end to end", "e2e_request_latency_seconds"),
                        ("queue", "request_queue_time_seconds")):
        n = f.total(name + "_count")
        mean = f.total(name + "_sum") / n if n else None
        rows.append([label, _num(n), _secs(mean), *(_secs(f.quantile(name, q)) for q in (0.5, 0.9, 0.99))])
    lines += _table(["", "count", "mean", "p50", "p90", "p99"], rows)

    depth = f.samples.get(P + "queue_depth", [])
    wait = {(lb["chip"], lb["queue"]): v for lb, v in f.samples.get(P + "queue_oldest_wait_seconds", [])}
    if depth:
        lines += ["", "queues (depth / oldest wait)"]
        queues = ["admission", "decode", "short", "medium", "long"]
        cells: dict[str, dict[str, str]] = defaultdict(dict)
        for lb, v in depth:
            w = wait.get((lb["chip"], lb["queue"]), 0.0)
            cells[lb["chip"]][lb["queue"]] = f"{_num(v)} / {_secs(w)}" if v else "0"
        rows = [[chip, *(c.get(q, "") for q in queues)] for chip, c in cells.items()]
        lines += _table(["chip", *queues], rows)

    jobs = f.by("decode_jobs_total", "profile")
    if jobs:
        lanes = f.by("decode_lanes_total", "profile")
        waste = f.by("decode_lane_waste_total", "profile")
        fill = f.by("batch_fill_ratio", "profile")
        lines += ["", "decode batches"]
        rows = [[f"B{p}", _num(jobs[p]), _num(lanes.get(p)), _num(waste.get(p)),
                 f"{100 * fill[p]:.0f} %" if p in fill else "-"]
                for p in sorted(jobs, key=int)]
        lines += _table(["profile", "jobs", "lanes", "lane waste", "fill"], rows)

    blocks = f.samples.get(P + "kv_blocks", [])
    if blocks:
        lines += ["", f"kv cache (usage {100 * f.total('kv_cache_usage_perc'):.1f} %)"]
        states = ["free", "used", "evictable", "quarantined"]
        per: dict[str, dict[str, float]] = defaultdict(dict)
        for lb, v in blocks:
            per[lb["chip"]][lb["state"]] = v
        lines += _table(["chip", *states], [[c, *(_num(s.get(k)) for k in states)] for c, s in per.items()])

    tier_blocks = f.by("kv_tier_blocks", "tier")
    if tier_blocks:
        lines += ["", "kv tiers (host pool shared by the board's chips; disk under kv.disk_dir)"]
        tb, cap = f.by("kv_tier_bytes", "tier"), f.by("kv_tier_capacity_blocks", "tier")
        hits, ev = f.by("kv_tier_hits_total", "tier"), f.by("kv_tier_evictions_total", "tier")
        rows = [[t, _num(tier_blocks[t]), _num(cap.get(t)), f"{tb.get(t, 0) / 2**20:.1f} MiB", _num(hits.get(t)),
                 _num(ev.get(t))] for t in ("host", "disk") if t in tier_blocks]
        lines += _table(["tier", "blocks", "capacity", "bytes", "hits", "evictions"], rows)
        misses = f.by("kv_tier_misses_total", "cause")
        dem = f.by("kv_tier_demotions_total", "why")
        lines.append(f"  promoted {_num(f.total('kv_tier_promotions_total'))} blocks   exported "
                     f"{_num(sum(dem.values()))}{detail(dem)}   moved "
                     f"{f.total('kv_tier_bytes_moved_total') / 2**20:.1f} MiB   misses "
                     f"{_num(sum(misses.values()))}{detail({k: v for k, v in misses.items() if v})}")
        lines.append(f"  transfer p50 export {_secs(f.quantile('kv_tier_transfer_seconds', 0.5, kind='kv_export'))}"
                     f"   import {_secs(f.quantile('kv_tier_transfer_seconds', 0.5, kind='kv_import'))}")

    chips = f.by("chip_up", "chip")
    if chips:
        lines += ["", "chips"]
        restarts = f.by("worker_restarts_total", "chip")
        inflight = f.by("jobs_inflight", "chip")
        rows = []
        for c in sorted(chips, key=int):
            rows.append([c, "up" if chips[c] else "DOWN", _num(restarts.get(c)), _num(inflight.get(c)),
                         _num(f.total("job_latency_seconds_count", chip=c)),
                         *(_secs(f.quantile("job_latency_seconds", 0.5, chip=c, kind=k)) for k in ("prefill", "decode"))])
        lines += _table(["chip", "state", "restarts", "in flight", "jobs", "prefill p50", "decode p50"], rows)
    lines += ["", f"loop: lag {_secs(f.total('loop_lag_seconds'))}, {_num(f.total('loop_turns_total'))} turns"
                  f"{rate('loop_turns_total')}"]
    return "\n".join(lines)
