"""`npuserve soak --tracemalloc DIR`: heap snapshots of the soak's own daemon and workers, and their diff.

The daemon is started with `NPUSERVE_TRACEMALLOC=DIR` (`workers.heap_snapshots`;
its workers inherit it); at every progress line and once at the end the soak
sends SIGUSR2 to the daemon and each worker, which write a snapshot. At the
end each process's first snapshot after warm-up is diffed against its last
(`tools.heap_diff`): the lines whose allocations grew most, next to the
anonymous RSS and glibc heap growth over the same span.
"""

from __future__ import annotations

import os
import time

import psutil

from tools.heap_diff import diff, snapshots_by_process
from workers.heap_snapshots import ENV, SIGNAL

# Dumping a snapshot stalls a process's loop for up to seconds: the soak's heartbeat must outlast it.
SETTINGS = ("recovery.heartbeat_timeout_ms=60000", "executor.job_timeout_ms=120000")


def env(directory: str) -> dict:
    os.makedirs(directory, exist_ok=True)
    return {**os.environ, ENV: os.path.abspath(directory)}


class HeapDumps:
    def __init__(self, directory: str, daemon_pid: int) -> None:
        self.dir = os.path.abspath(directory)
        self.pid = daemon_pid
        self.times: list[float] = []  # when each round of SIGUSR2 was sent (seconds since the soak began)
        self.sent: dict[int, int] = {}  # pid -> signals sent

    def request(self, t: float) -> None:
        """Ask the daemon and every worker for a snapshot now."""
        try:
            pids = [self.pid, *(k.pid for k in psutil.Process(self.pid).children(recursive=True))]
        except psutil.Error:
            return
        self.times.append(t)
        for pid in pids:
            try:
                os.kill(pid, SIGNAL)
                self.sent[pid] = self.sent.get(pid, 0) + 1
            except ProcessLookupError:
                pass

    def wait_written(self, timeout: float = 60.0) -> None:
        """Until every process still alive has written the snapshots it was asked for."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            have = {pid: len(p) for (_, pid), p in snapshots_by_process(self.dir).items()}
            if all(have.get(pid, 0) >= n or not psutil.pid_exists(pid) for pid, n in self.sent.items()):
                return
            time.sleep(0.2)

    def diffs(self, warmup_s: float, top: int = 12) -> list[dict]:
        """Per process: its first snapshot asked for at or after `warmup_s` against its last."""
        first = next((i for i, t in enumerate(self.times) if t >= warmup_s), 0)
        out = []
        for (role, pid), paths in snapshots_by_process(self.dir).items():
            # a worker started later (a restart) has fewer snapshots: count back from its last
            i = max(0, min(first - (len(self.times) - len(paths)), len(paths) - 2)) if len(paths) >= 2 else None
            if i is None:
                continue
            d = diff(paths[i], paths[-1], top)
            out.append({"role": role, "pid": pid, "from_snapshot": i + 1, "snapshots": len(paths), **d})
        return out

