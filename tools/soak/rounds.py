"""The switching soak's schedule and its leak checks over rounds and per worker process.

Periods (`--switch-every`, `--fault-every`) are in `tools.soak.periods`.

A **round** ends just before each switch (and at the end of the run): the
soak waits until the board is settled (one generation left for the alias,
every chip up, one worker per chip) and takes a sample of the daemon tree.
Sampled at the same point of every round, the daemon's memory, the FDs,
threads and child processes, and the `/dev/shm` objects must stay flat
across rounds: an old generation whose rings, sockets or workers outlive
it shows up here as a count that grows by the same amount every round.

Workers change with every switch (each generation starts its own) and with
every worker fault, so the continuous per-request fit over the summed
workers sees a saw-tooth; each worker process is therefore also fitted on
its own samples over its own life (after its own warm-up).
"""

from __future__ import annotations

import time

from tools.soak.resources import COUNT_METRICS, MEMORY_METRICS, LeakThresholds, Sample, leak_verdict, theil_sen

WORKER_MEMORY = ("anon_rss",)
WORKER_COUNTS = ("fds",)


def settled(endpoint: str, alias: str, chips: int, daemon_pid: int) -> str | None:
    """None when the board is settled for a round sample, else what it still waits for."""
    import psutil

    from engine.client import Client
    from engine.errors import ClientError

    try:
        with Client(endpoint, timeout=10) as c:
            models = c.call("models")
            h = c.health()
    except ClientError as e:
        return f"the daemon did not answer: {e}"
    live = [m for m in models.get("models", []) if m.get("alias") == alias
            and m.get("state") not in ("unloaded", "failed")]
    if len(live) != 1 or live[0].get("state") != "ready":
        return f"generations of {alias!r}: {[(m.get('generation'), m.get('state')) for m in live]}"
    if h.get("chips_up") != chips:
        return f"{h.get('chips_up')} of {chips} chips up"
    try:
        kids = len(psutil.Process(daemon_pid).children(recursive=True))
    except psutil.Error:
        return "the daemon is gone"
    return None if kids == chips else f"{kids} worker processes for {chips} chips"


def wait_settled(endpoint: str, alias: str, chips: int, daemon_pid: int, timeout: float) -> str | None:
    """Wait until `settled`; None when it is, else the last thing it waited for."""
    deadline = time.monotonic() + timeout
    while True:
        why = settled(endpoint, alias, chips, daemon_pid)
        if why is None or time.monotonic() > deadline:
            return why
        time.sleep(0.1)


def per_worker(samples: list[Sample], th: LeakThresholds) -> list[dict]:
    """Each worker process fitted on its own samples (time rebased to its first one)."""
    series: dict[int, list[Sample]] = {}
    for s in samples:
        for pid, v in (s.values.get("procs") or {}).items():
            series.setdefault(pid, []).append(Sample(s.t, s.requests, v))
    out = []
    for pid, ss in series.items():
        v = leak_verdict(ss, th, memory=WORKER_MEMORY, counts=WORKER_COUNTS)
        row = {"pid": pid, "first_t_s": round(ss[0].t, 1), "life_s": round(ss[-1].t - ss[0].t, 1),
               "samples": len(ss), "enough_samples": v.get("enough_samples", False)}
        if v.get("enough_samples"):
            row.update(anon_rss_per_request=v["anon_rss"]["per_request"],
                       anon_rss_late_per_request=v["anon_rss"]["late_per_request"],
                       anon_rss_growth=v["anon_rss"]["growth"], fds_start=v["fds"]["start"], fds_end=v["fds"]["end"],
                       fds_growth=v["fds"]["growth"], leak=v["leak"],
                       leaked=[k for k in (*WORKER_MEMORY, *WORKER_COUNTS) if v[k]["leak"]])
        out.append(row)
    return out


def per_switch(samples: list[Sample], warmup_fraction: float) -> dict:
    """Each round metric's Theil-Sen slope per round (= per switch) after warm-up: what one generation
    leaves behind, whatever the requests it served. Reported, not judged: a generation's share of the
    allocator's arenas is not a leak, and no threshold separates the two yet."""
    if len(samples) < 4:
        return {}
    t0, t1 = samples[0].t, samples[-1].t
    idx = [(i, s) for i, s in enumerate(samples) if s.t >= t0 + (t1 - t0) * warmup_fraction]
    xs = [float(i) for i, _ in idx]
    return {m: round(theil_sen(xs, [float(s.values.get(m, 0)) for _, s in idx]), 3)
            for m in MEMORY_METRICS + COUNT_METRICS}
