"""Chip worker faults under load: `kill -9`, SIGSTOP past the heartbeat timeout, a backend that raises.

The daemon must fail only the lanes that were on the broken chip (500;
requests that had emitted no token are requeued and finish), bring the chip
back (a fresh worker, READY) and keep serving; its rings are replaced, not
leaked.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from tools.chaos.harness import (SLOW_SIM, DaemonUnderTest, ScenarioResult, check_traces, serves_fresh_requests,
                                 stream_all, wait_until)
from tools.load.local_daemon import shm_of
from tools.load.wire_load import WireLoad


def _chip_back(d: DaemonUnderTest, chip: int, old_pid: int):
    c = d.chip(chip)
    return c if c.get("state") == "up" and c.get("pid") not in (None, old_pid) else None


async def _load_then(d: DaemonUnderTest, n: int, max_tokens: int, fault) -> tuple[list, object]:
    """Start `n` streams, run `fault()` (in a thread) once every one has its first token, wait for all."""
    load = WireLoad(d.endpoint)
    try:
        task = asyncio.ensure_future(stream_all(load, n, max_tokens))
        deadline = time.monotonic() + 60
        while (len(load.traces) < n or any(t.first is None for t in load.traces.values())) \
                and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.02)
        out = await asyncio.to_thread(fault)
        traces = await task
        await asyncio.sleep(0.3)  # anything sent after a terminal event shows now
        return traces, out
    finally:
        await load.close()


def worker_kill(res: ScenarioResult) -> None:
    """kill -9 of chip 0's worker with 40 streams in flight on 2 sim chips."""
    with DaemonUnderTest(res, backend="sim", chips=2, backend_options=SLOW_SIM) as d:
        victim = d.chip(0)["pid"]
        shm_before = shm_of({d.d.pid})

        def fault():
            os.kill(victim, signal.SIGKILL)
            return wait_until(lambda: _chip_back(d, 0, victim), 15)

        traces, (back, waited) = asyncio.run(_load_then(d, 40, 200, fault))
        res.faults, res.requests = 1, len(traces)
        res.recovery_s = waited if back else None
        res.expect(back is not None, "chip 0 did not come back within 15 s")
        check_traces(res, traces, allowed_errors={500})
        failed = sum(1 for t in traces if t.error_code == 500)
        res.details.update(killed_pid=victim, failed_lanes=failed, restarts=(back or {}).get("restarts_total"))
        res.expect(failed > 0, "no request was failed although the killed worker had lanes in flight")
        serves_fresh_requests(res, d.endpoint)
        res.expect(shm_of({victim})[0] == 0, "the killed worker's shared memory is still in /dev/shm")
        res.expect(shm_of({d.d.pid})[0] == shm_before[0], "the daemon's ring count changed across the restart")


def worker_stop(res: ScenarioResult) -> None:
    """SIGSTOP chip 0's worker past the heartbeat timeout (600 ms), then SIGCONT."""
    with DaemonUnderTest(res, backend="sim", chips=2, backend_options=SLOW_SIM,
                         settings=["recovery.heartbeat_interval_ms=200", "recovery.heartbeat_timeout_ms=600"]) as d:
        victim = d.chip(0)["pid"]

        def fault():
            os.kill(victim, signal.SIGSTOP)
            try:
                back = wait_until(lambda: _chip_back(d, 0, victim), 15)
            finally:
                try:
                    os.kill(victim, signal.SIGCONT)  # already SIGKILLed by the daemon: harmless
                except ProcessLookupError:
                    pass
            return back

        traces, (back, waited) = asyncio.run(_load_then(d, 40, 200, fault))
        res.faults, res.requests = 1, len(traces)
        res.recovery_s = waited if back else None
        res.expect(back is not None, "chip 0 was not declared dead and replaced within 15 s")
        if back:
            res.expect("heartbeat" in back.get("last_failure", ""), f"failure reason {back.get('last_failure')!r}")
            res.details["last_failure"] = back.get("last_failure")
        check_traces(res, traces, allowed_errors={500})
        serves_fresh_requests(res, d.endpoint)
        res.expect(shm_of({victim})[0] == 0, "the stopped worker's shared memory is still in /dev/shm")


def backend_raises(res: ScenarioResult) -> None:
    """The backend of chip 0 raises on its 60th job (`fail_job`): that job's lanes fail, nothing else."""
    with DaemonUnderTest(res, backend="sim", chips=2,
                         backend_options=[*SLOW_SIM, "fail_job=60", "fail_chip=0"]) as d:
        pid = d.chip(0)["pid"]
        traces, _ = asyncio.run(_load_then(d, 40, 100, lambda: None))
        res.faults, res.requests = 1, len(traces)
        check_traces(res, traces, allowed_errors={500})
        failed = [t for t in traces if t.error_code == 500]
        res.details["failed_requests"] = len(failed)
        # One job holds at most 16 lanes; lanes that had emitted no token are requeued instead of failed.
        res.expect(len(failed) <= 16, f"{len(failed)} requests failed; one job holds at most 16 lanes")
        c = d.chip(0)
        res.expect(c.get("pid") == pid and c.get("state") == "up",
                   "a failed job must not take the worker down (it is the backend's error, not the process's)")
        serves_fresh_requests(res, d.endpoint)
        from tools.load.local_daemon import stats

        s = stats(d.endpoint)
        res.details["failed_jobs"] = s["scheduler"]["counters"].get("failed_jobs")
        res.expect(s["scheduler"]["counters"].get("failed_jobs") == 1, "the daemon did not count exactly one failed job")
        res.recovery_s = 0.0
