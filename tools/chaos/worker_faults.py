"""Chip worker faults under load: `kill -9` (also with two jobs and a queued next step in flight), SIGSTOP
past the heartbeat timeout, a backend that raises.

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
from tools.load.local_daemon import shm_of, stats
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
        s = stats(d.endpoint)
        res.details["failed_jobs"] = s["scheduler"]["counters"].get("failed_jobs")
        res.expect(s["scheduler"]["counters"].get("failed_jobs") == 1, "the daemon did not count exactly one failed job")
        res.recovery_s = 0.0


# Ping/pong plus queued next steps: the most a frozen or killed worker can have in flight. No prefix cache: an
# idle chip's KV pool is then all free, so "back to its value before the load" is exact (a cache would keep
# blocks of finished prompts). Heartbeats every 200 ms: a worker let run for a moment between two freezes is
# heard from.
INFLIGHT = ("executor.max_inflight=2", "executor.queue_next_step=true", "kv.prefix_cache=false",
            "recovery.heartbeat_interval_ms=200")


def _chip_stats(d: DaemonUnderTest, chip: int) -> tuple[dict, dict]:
    s = stats(d.endpoint)["scheduler"]
    return s, s["chips"][str(chip)]


def _kv_idle(res: ScenarioResult, d: DaemonUnderTest, before: dict, when: str) -> dict:
    """Nothing of the load left in the scheduler or the chip's KV: block counts back to `before`, no sequence held."""
    s, c = _chip_stats(d, 0)
    kv = c["kv"]
    res.expect(kv["blocks"] == before, f"{when}: KV blocks {kv['blocks']}, before the load {before}")
    res.expect(not any(kv["sequences"].values()), f"{when}: KV sequences still held: {kv['sequences']}")
    res.expect(c["inflight"] == 0 and c["queued_steps_inflight"] == 0 and c["bound"] == 0,
               f"{when}: chip 0 still holds jobs {c['inflight']}, queued steps {c['queued_steps_inflight']}, "
               f"bound requests {c['bound']}")
    res.expect(s["active_sequences"] == 0, f"{when}: {s['active_sequences']} sequences still admitted")
    return kv["blocks"]


def _settled(d: DaemonUnderTest) -> dict:
    """Chip 0's stats once two reads in a row agree (the daemon has read all a stopped worker wrote)."""
    prev = None
    for _ in range(40):
        time.sleep(0.03)
        _, c = _chip_stats(d, 0)
        now = (c["inflight"], c["queued_steps_inflight"], c["bound"], c["jobs_submitted"])
        if now == prev:
            break
        prev = now
    return c


async def _freeze_in_flight(d: DaemonUnderTest, pid: int, load: WireLoad, nudges: list,
                            max_stopped_s: float = 3.0) -> tuple[dict | None, list]:
    """SIGSTOP the worker until the daemon's settled view of chip 0 holds two jobs and a queued next step.

    A stopped worker answers nothing more: once the daemon has read what it wrote before the stop, what
    the stats show is what the chip holds when the kill lands. Otherwise one more stream is sent (into
    `nudges`) and the worker runs on for a moment before it is caught again: lanes that all share one job
    get a queued step behind it and nothing beside it (one job and its follower), and the newcomer's
    prompt job and lane split them (its lane takes its turn among theirs, `BatchPlanner.decode_candidates`,
    even when they fill the profile). Stopped for at most `max_stopped_s` in all, well within the heartbeat
    timeout. Returns (the chip's stats or None, the settled (jobs, queued steps) of every attempt).
    """
    seen: list = []
    stopped = 0.0
    while stopped < max_stopped_s:
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        c = await asyncio.to_thread(_settled, d)
        seen.append((c["inflight"], c["queued_steps_inflight"]))
        if c["inflight"] >= 3 and c["queued_steps_inflight"] >= 1:
            return c, seen
        k = len(nudges)
        nudges.append(await load.start([50 + k, 51, 52], max_tokens=300, seed=50 + k, ignore_eos=True))
        os.kill(pid, signal.SIGCONT)
        stopped += time.monotonic() - t0
        await asyncio.sleep(0.3)  # heartbeats get out, the newcomer's prompt runs
    return None, seen


def worker_kill_inflight(res: ScenarioResult) -> None:
    """kill -9 of a worker holding two jobs and a queued next step (ping/pong + executor.queue_next_step)."""
    with DaemonUnderTest(res, backend="sim", chips=1, backend_options=SLOW_SIM, settings=INFLIGHT) as d:
        victim = d.chip(0)["pid"]
        shm_before = shm_of({d.d.pid})
        s0, c0 = _chip_stats(d, 0)
        kv_before, requeued_before = c0["kv"]["blocks"], s0["counters"].get("requeued", 0)

        async def run():
            load = WireLoad(d.endpoint)
            try:
                # 12 streams long enough to be mid-stream at the kill (12: one more fills a 16-lane profile)
                early = [await load.start([1 + (i + k) % 200 for k in range(3)], max_tokens=1500, seed=i,
                                          ignore_eos=True) for i in range(12)]
                deadline = time.monotonic() + 60
                while any(t.first is None for t in early) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                held, views = await _freeze_in_flight(d, victim, load, early)
                # lanes with no token yet: admitted to the frozen chip (prefill waiting), requeued by the kill
                late = [await load.start([7 + (i + k) % 200 for k in range(3)], max_tokens=8, seed=100 + i,
                                         ignore_eos=True) for i in range(4)] if held else []
                if held:
                    await asyncio.to_thread(  # briefly: the worker stays frozen meanwhile
                        wait_until, lambda: _chip_stats(d, 0)[1]["bound"] >= held["bound"] + len(late), 2)
                    _, held = await asyncio.to_thread(_chip_stats, d, 0)  # the state the kill meets
                tokens_at_kill = {t.rid: len(t.tokens) for t in early + late}
                try:
                    os.kill(victim, signal.SIGKILL)
                except ProcessLookupError:  # the daemon replaced it first (heartbeat silence): nothing was killed
                    res.fail("chip 0's worker was gone before the kill")
                back = await asyncio.to_thread(wait_until, lambda: _chip_back(d, 0, victim), 15)
                await asyncio.gather(*(load.finished(t, 60) for t in early + late))
                await asyncio.sleep(0.3)  # anything sent after a terminal event shows now
                return early + late, held, views, tokens_at_kill, back
            finally:
                await load.close()

        traces, held, views, tokens_at_kill, (back, waited) = asyncio.run(run())
        res.faults, res.requests = 1, len(traces)
        res.recovery_s = waited if back else None
        res.details.update(killed_pid=victim, frozen_views=views)
        if held is None:
            res.fail(f"chip 0 never held two jobs and a queued next step when frozen (SIGSTOP); "
                     f"(jobs, queued steps) seen: {views}")
        else:
            res.details["at_kill"] = {k: held[k] for k in ("inflight", "queued_steps_inflight", "bound")}
            res.expect(held["inflight"] >= 3 and held["queued_steps_inflight"] >= 1,
                       f"at the kill chip 0 held {held['inflight']} jobs, {held['queued_steps_inflight']} queued steps")
        res.expect(back is not None, "chip 0 did not come back within 15 s")
        check_traces(res, traces, allowed_errors={500})
        for t in traces:  # 500 only for a lane that had streamed; one that had not is requeued and finishes
            had = tokens_at_kill.get(t.rid, 0)
            if t.error_code == 500 and not had:
                res.fail(f"request {t.rid} failed (500) although it had streamed no token: it must be requeued")
            if not had and not (t.terminal and t.terminal["ev"] == "done"):
                res.fail(f"request {t.rid} had no token at the kill but ended {t.terminal}")
        s, _ = _chip_stats(d, 0)
        failed = sum(1 for t in traces if t.error_code == 500)
        requeued = s["counters"].get("requeued", 0) - requeued_before
        res.details.update(failed_lanes=failed, requeued=requeued, restarts=(back or {}).get("restarts_total"))
        res.expect(failed > 0, "no request was failed although the killed worker had streaming lanes in flight")
        res.expect(requeued > 0, "no request was requeued although lanes without a token were on the chip")
        res.details["kv_blocks_after"] = _kv_idle(res, d, kv_before, "after the load")
        serves_fresh_requests(res, d.endpoint)
        _kv_idle(res, d, kv_before, "after the fresh requests")
        res.expect(shm_of({victim})[0] == 0, "the killed worker's shared memory is still in /dev/shm")
        res.expect(shm_of({d.d.pid})[0] == shm_before[0], "the daemon's ring count changed across the restart")
