"""How much idle processes wake and run: the check that a process with nothing to do sleeps."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass
class IdleActivity:
    """What a set of processes did per wall second while nothing was asked of them."""

    wakeups_per_s: float  # voluntary context switches, summed over every thread
    cpu_share: float  # scheduler run time (ns-exact, not 10 ms ticks) per wall second
    busiest: list[str]  # the threads that woke most, for the failure message

    def __str__(self) -> str:
        return f"{self.wakeups_per_s:.0f} wake-ups/s, {100 * self.cpu_share:.1f} % of a core; busiest: {self.busiest}"


def _thread_counters(procs) -> dict[tuple[int, int], tuple[str, int, int]]:
    """(pid, tid) -> (thread name, run time ns, voluntary switches), from /proc/PID/task/TID."""
    out = {}
    for p in procs:
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            base = f"/proc/{p.pid}/task/{tid}"
            try:
                with open(f"{base}/schedstat") as f:
                    ran_ns = int(f.read().split()[0])
                with open(f"{base}/status") as f:
                    status = f.read()
                with open(f"{base}/comm") as f:
                    name = f.read().strip()
            except (FileNotFoundError, ProcessLookupError):
                continue
            vol = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
            out[(p.pid, int(tid))] = (name, ran_ns, vol)
    return out


def idle_activity(procs, window_s: float = 2.0, tries: int = 3,
                  max_wakeups_per_s: float = float("inf"), max_cpu_share: float = 1.0) -> IdleActivity:
    """Wake-ups and CPU of idle `procs`, the quietest of up to `tries` windows.

    "Idle processes sleep" means two things, both independent of how fast the
    machine is: they wake a bounded number of times a second (timers, heart-
    beats), and they do not spin between wake-ups. CPU share alone is not a
    portable measure: on some VMs one wake-up costs ~1 ms of CPU. Stops at the
    first window within both bounds; a process that really busy-waits is
    outside them in every window.
    """
    best = None
    for _ in range(tries):
        before = _thread_counters(procs)
        t0 = time.monotonic()
        time.sleep(window_s)
        elapsed = time.monotonic() - t0
        after = _thread_counters(procs)
        per_thread = []
        ran = woke = 0
        for key, (name, ran1, vol1) in after.items():
            if key in before:
                _, ran0, vol0 = before[key]
                ran += ran1 - ran0
                woke += vol1 - vol0
                per_thread.append(((vol1 - vol0) / elapsed, f"{key[0]}/{name}"))
        per_thread.sort(reverse=True)
        act = IdleActivity(woke / elapsed, ran / 1e9 / elapsed,
                           [f"{who} {rate:.0f}/s" for rate, who in per_thread[:4]])
        if best is None or (act.wakeups_per_s, act.cpu_share) < (best.wakeups_per_s, best.cpu_share):
            best = act
        if act.wakeups_per_s <= max_wakeups_per_s and act.cpu_share <= max_cpu_share:
            return act
    return best
