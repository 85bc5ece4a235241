"""Resource trend of the engine's processes and its shared memory, and the leak verdict.

Sampled with psutil: per process (the daemon and every worker, found as the
daemon's children) RSS, open file descriptors, threads and children; and the
daemon's /dev/shm objects (segments and semaphores whose name carries the
daemon's or a worker's pid), count and bytes.

The leak verdict uses only the samples after warm-up (allocator arenas,
caches and the prefix cache fill up first) and a robust slope: Theil-Sen, the
median of the pairwise slopes, which one step (an arena growing by 1 MB) does
not move the way it moves a least-squares fit.

* Memory (daemon and summed worker anonymous RSS, shm bytes allocated) is a leak when its slope
  per request exceeds `rss_bytes_per_request` (default 512 B: half of the
  1 KB/request growth the soak must catch, so that leak is flagged with a 2x
  margin), AND so does the slope over the second half of the window (growth
  that is still going on: the ref backend's KV arrays and the rings are
  touched page by page for a while and then stay flat, a leak does not stop),
  AND the fitted growth over the window exceeds `rss_floor_bytes`
  (default 1 MiB: below that, CPython's allocator moves RSS in steps as large
  as the signal). A 1 KB/request leak is therefore flagged once about 1,000
  requests have run after warm-up: within the first minute of a stub or ref
  soak on this machine.
* Counts (FDs, threads, children, shm objects) are a leak when the fitted
  growth over the window is at least `count_growth` (default 2) and the
  minimum of the last quarter of samples exceeds the maximum of the first
  quarter (a rise that stays, not a transient one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

from tools.load.local_daemon import shm_of

MEMORY_METRICS = ("daemon_anon_rss", "workers_anon_rss", "shm_bytes")
COUNT_METRICS = ("daemon_fds", "workers_fds", "daemon_threads", "workers_threads", "children", "shm_objects")


@dataclass(frozen=True)
class LeakThresholds:
    rss_bytes_per_request: float = 512.0
    rss_floor_bytes: float = 1 << 20
    count_growth: float = 2.0
    warmup_fraction: float = 0.25


@dataclass
class Sample:
    t: float  # seconds since the start
    requests: int  # requests finished so far
    values: dict = field(default_factory=dict)


def _anon(mem) -> int:
    """Private anonymous memory (the heap): RSS minus file-backed and shared pages.

    Plain RSS also counts the shared-memory ring pages a process has touched,
    which grow for the first minutes (until every ring has wrapped once) and
    would read as a leak of ~10 KB/request.
    """
    return mem.rss - getattr(mem, "shared", 0)


def measure(daemon_pid: int) -> dict:
    """One sample of the daemon process tree (a vanished process counts as zero); `procs` holds each
    worker's own {"anon_rss", "fds"} by pid (workers come and go with model switches and faults)."""
    v: dict = dict.fromkeys(MEMORY_METRICS + COUNT_METRICS, 0)
    v["procs"] = {}
    try:
        d = psutil.Process(daemon_pid)
        with d.oneshot():
            v["daemon_anon_rss"] = _anon(d.memory_info())
            v["daemon_fds"] = d.num_fds()
            v["daemon_threads"] = d.num_threads()
            kids = d.children(recursive=True)
    except psutil.Error:
        return v
    v["children"] = len(kids)
    pids = {daemon_pid}
    for k in kids:
        try:
            with k.oneshot():
                anon, fds = _anon(k.memory_info()), k.num_fds()
                v["workers_anon_rss"] += anon
                v["workers_fds"] += fds
                v["workers_threads"] += k.num_threads()
            v["procs"][k.pid] = {"anon_rss": anon, "fds": fds}
            pids.add(k.pid)
        except psutil.Error:
            pass
    v["shm_objects"], v["shm_bytes"] = shm_of(pids)
    return v


def theil_sen(xs: list[float], ys: list[float], max_points: int = 400) -> float:
    """Median of pairwise slopes (over at most `max_points` evenly spaced samples)."""
    n = len(xs)
    if n < 2:
        return 0.0
    step = max(1, n // max_points)
    xs, ys = xs[::step], ys[::step]
    slopes = sorted((ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
                    if xs[j] != xs[i])
    return slopes[len(slopes) // 2] if slopes else 0.0


def leak_verdict(samples: list[Sample], th: LeakThresholds = LeakThresholds(),
                 memory: tuple[str, ...] = MEMORY_METRICS, counts: tuple[str, ...] = COUNT_METRICS) -> dict:
    """Per metric (`memory` ones in bytes, `counts`): start/end values after warm-up, slope per request,
    fitted growth, and `leak` (bool). Warm-up is the first `warmup_fraction` of the samples' time span."""
    if len(samples) < 8:
        return {"enough_samples": False}
    t_start, t_end = samples[0].t, samples[-1].t
    post = [s for s in samples if s.t >= t_start + (t_end - t_start) * th.warmup_fraction]
    if len(post) < 6 or post[-1].requests <= post[0].requests:
        return {"enough_samples": False}
    out: dict = {"enough_samples": True, "warmup_s": round(post[0].t, 1),
                 "requests_after_warmup": post[-1].requests - post[0].requests}
    xs = [float(s.requests) for s in post]
    span = xs[-1] - xs[0]
    q = max(1, len(post) // 4)
    for m in memory + counts:
        ys = [float(s.values.get(m, 0)) for s in post]
        slope = theil_sen(xs, ys)
        growth = slope * span
        half = len(xs) // 2
        late = theil_sen(xs[half:], ys[half:])
        if m in memory:
            leak = (slope > th.rss_bytes_per_request and late > th.rss_bytes_per_request
                    and growth > th.rss_floor_bytes)
        else:
            leak = growth >= th.count_growth and min(ys[-q:]) > max(ys[:q])
        out[m] = {"start": ys[0], "end": ys[-1], "per_request": round(slope, 3),
                  "late_per_request": round(late, 3), "growth": round(growth, 1), "leak": bool(leak)}
    out["leak"] = any(v["leak"] for k, v in out.items() if isinstance(v, dict))
    return out


class Sampler:
    """Samples the daemon tree; `every_s` apart at most, called from the soak's loop."""

    def __init__(self, daemon_pid: int | None, every_s: float = 1.0) -> None:
        self.pid = daemon_pid
        self.every_s = every_s
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()
        self._next = 0.0

    def maybe_sample(self, requests: int) -> Sample | None:
        if self.pid is None:
            return None
        now = time.monotonic() - self.t0
        if now < self._next:
            return None
        self._next = now + self.every_s
        s = Sample(round(now, 3), requests, measure(self.pid))
        self.samples.append(s)
        return s
