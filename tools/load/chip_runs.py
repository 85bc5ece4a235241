"""What the chips did during a run, from the daemon's `stats` deltas or the simulator's virtual chips.

Reported side by side so that a gap between a daemon run and the simulator's
prediction can be read off (idle device time, a different job mix) instead of
guessed.
"""

from __future__ import annotations

COUNTERS = ("decode_jobs", "decode_lanes", "prefill_jobs", "prefill_tokens")
DAEMON_ONLY = ("mixed_jobs", "preemptions")  # counted by the daemon's scheduler, not the simulator's summary


def daemon_run(before: dict, after: dict, window_s: float) -> dict:
    """Stats deltas: per-chip `device_s` against the window, job counts, lanes per decode job.

    `device_busy` below 1 is time the chip ran no modelled work: host overhead
    between jobs, start-up and the tail when the chip had nothing left to do.
    """
    b_c, a_c = before["scheduler"]["counters"], after["scheduler"]["counters"]
    counters = {k: a_c.get(k, 0) - b_c.get(k, 0) for k in COUNTERS + DAEMON_ONLY}
    b_chips = {c["chip"]: c for c in before["chips"]}
    device = [round(c["device_s"] - b_chips[c["chip"]]["device_s"], 3) for c in after["chips"]]
    worker = [round(c["worker_s"] - b_chips[c["chip"]]["worker_s"], 3) for c in after["chips"]]
    jobs = [after["scheduler"]["chips"][str(c["chip"])]["jobs_submitted"]
            - before["scheduler"]["chips"][str(c["chip"])]["jobs_submitted"] for c in after["chips"]]
    return {"window_s": round(window_s, 3), "device_s": device, "worker_s": worker,
            "device_busy": [round(d / max(window_s, 1e-9), 4) for d in device], "jobs": jobs, **counters,
            "mean_decode_lanes": round(counters["decode_lanes"] / max(counters["decode_jobs"], 1), 2)}


def sim_run(r) -> dict:
    """The simulator's run (`engine.sim.SimResult`) in the shape of `daemon_run` (window = makespan from t = 0)."""
    pc = r.per_chip
    counters = {k: sum(c[k] for c in pc) for k in COUNTERS}
    return {"window_s": round(r.makespan_s, 3), "device_s": [round(c["busy_s"], 3) for c in pc],
            "device_busy": [round(c["busy_s"] / max(r.makespan_s, 1e-9), 4) for c in pc],
            "jobs": [c["decode_jobs"] + c["prefill_jobs"] for c in pc], **counters,
            "mean_decode_lanes": round(counters["decode_lanes"] / max(counters["decode_jobs"], 1), 2)}
