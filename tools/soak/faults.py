"""Chaos faults injected into the soak's running board, taken in turn from the chaos tool's set.

Each one is the chaos scenario's own injection (`tools.chaos.worker_faults`,
`tools.chaos.client_faults`), aimed at the soak's daemon instead of a
scenario's, and each has the chaos scenario's recovery condition:

* `worker-kill`: `kill -9` of a chip's worker; recovered when the chip
  serves again with a new worker. Lanes streaming on it end with 500.
* `worker-stop`: SIGSTOP of a chip's worker until the daemon declares it
  dead (`recovery.heartbeat_timeout_ms`) and replaces it, then SIGCONT;
  recovered as above.
* `clients-vanish`: three client processes with 10 long streams each are
  `kill -9`ed mid-stream; recovered when the daemon has cancelled all 30
  (`cancelled_dead_clients`). The soak's own requests are not touched.

The chip alternates (fault n hits chip n mod chips).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

FAULTS = ("worker-kill", "worker-stop", "clients-vanish")
WORKER_FAULTS = frozenset({"worker-kill", "worker-stop"})
VANISH_CLIENTS, VANISH_STREAMS = 3, 10


@dataclass
class Fault:
    n: int
    name: str
    started: float  # time.monotonic()
    ended: float | None = None
    chip: int | None = None
    victim: int | None = None
    recovered: bool = False
    recovery_s: float | None = None
    detail: str = ""

    def row(self, t0: float) -> dict:
        return {"fault": self.n, "name": self.name, "t_s": round(self.started - t0, 1), "chip": self.chip,
                "victim_pid": self.victim, "recovered": self.recovered,
                "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 2), "detail": self.detail}


def inject(f: Fault, endpoint: str, chips: int, timeout: float) -> Fault:
    """Inject `f` (its number `n` is 1-based), blocking until recovered or `timeout` (call from a thread)."""
    from tools.chaos.harness import health, wait_until
    from tools.load.local_daemon import stats

    n, name = f.n, f.name
    f.started = time.monotonic()
    try:
        if name in WORKER_FAULTS:
            from tools.chaos.worker_faults import kill_worker, stop_worker

            f.chip = (n - 1) % chips
            h = health(endpoint) or {}
            f.victim = ((h.get("chips") or [{}] * chips)[f.chip]).get("pid")
            if f.victim is None:
                f.detail = f"chip {f.chip} had no worker to hit"
                return f
            back, waited = (kill_worker if name == "worker-kill" else stop_worker)(endpoint, f.chip, f.victim,
                                                                                   timeout)
            f.recovered = back is not None
            f.recovery_s = waited if back else None
            f.detail = (f"chip {f.chip} back with pid {back['pid']}" if back else
                        f"chip {f.chip} not back within {timeout:.0f} s")
        elif name == "clients-vanish":
            from tools.chaos.client_faults import vanishing_clients

            want = VANISH_CLIENTS * VANISH_STREAMS
            before = stats(endpoint)["daemon"]["cancelled_dead_clients"]
            killed = {}
            why = vanishing_clients(endpoint, VANISH_CLIENTS, VANISH_STREAMS,
                                    on_ready=lambda: killed.update(t=time.monotonic()))
            if why is not None:
                f.detail = why
                return f
            done, _ = wait_until(lambda: stats(endpoint)["daemon"]["cancelled_dead_clients"] - before >= want,
                                 timeout, every=0.1)
            got = stats(endpoint)["daemon"]["cancelled_dead_clients"] - before
            f.recovered = bool(done) and got == want
            f.recovery_s = time.monotonic() - killed["t"] if f.recovered else None
            f.detail = f"{got} of {want} orphaned streams cancelled"
        else:
            f.detail = f"unknown fault {name!r}"
    except Exception as e:  # a fault that cannot run is an unrecovered fault, with the reason
        f.detail = f"{type(e).__name__}: {e}"
    finally:
        f.ended = time.monotonic()
    return f
