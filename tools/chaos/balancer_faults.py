"""A board daemon `kill -9`ed behind a real balancer under load, then restarted on the same endpoint.

The balancer (`npuserve balance`, round-robin over two 1-chip sim daemons on
tcp://) must migrate the streams the kill broke (or end them with one
retryable 503), take the dead backend out, and route to it again once it is
restarted; the killed daemon's workers and /dev/shm objects must not outlive
it (its workers exit on their parent's death, the restarted daemon reaps
what is left).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tools.chaos.harness import SLOW_SIM, DaemonUnderTest, ScenarioResult, check_traces, health, stream_all, wait_until
from tools.load.local_daemon import alive_pid, shm_of
from tools.load.ports import free_port
from tools.load.wire_load import WireLoad

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class BalancerUnderTest:
    """`with BalancerUnderTest(res, backends) as b:` a balancer process on ipc://, every backend up; SIGTERM on exit."""

    def __init__(self, res: ScenarioResult, backends: list[str]) -> None:
        self.res = res
        self.tmp = tempfile.mkdtemp(prefix="npcb-", dir="/tmp")
        self.endpoint = f"ipc://{self.tmp}/b.sock"
        cfg = os.path.join(self.tmp, "balancer.toml")
        with open(cfg, "w") as fh:
            fh.write('schema = "npuserve-balancer/v1"\n[balancer]\n'
                     f'endpoints = ["{self.endpoint}"]\npolicy = "round-robin"\n'
                     + "".join(f'[[backends]]\nendpoint = "{b}"\n' for b in backends))
        self.log_path = os.path.join(self.tmp, "balancer.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "engine.balancer.main", "--config", cfg], cwd=ROOT,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.n = len(backends)

    def __enter__(self) -> "BalancerUnderTest":
        up, _ = wait_until(lambda: self.proc.poll() is not None or (health(self.endpoint, 1) or {}).get(
            "backends_up", 0) >= self.n, 60, every=0.1)
        if not up or self.proc.poll() is not None:
            self.__exit__()
            raise RuntimeError(f"balancer not routing to {self.n} backends within 60 s:\n{self.log_tail()}")
        return self

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()[-n:]

    def backend(self, endpoint: str) -> dict:
        h = health(self.endpoint, 2) or {}
        return next((x for x in h.get("balancer", {}).get("backends", []) if x["endpoint"] == endpoint), {})

    def counters(self) -> dict:
        from engine.client import Client

        with Client(self.endpoint, timeout=10) as c:
            return c.stats()["balancer"]

    def __exit__(self, *exc) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            if self.proc.returncode != 0:
                self.res.fail(f"balancer exited {self.proc.returncode} after SIGTERM, expected 0")
            if self.res.problems:
                self.res.details["balancer_log_tail"] = self.log_tail(1500)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _served_through_balancer(b: BalancerUnderTest, endpoint: str) -> bool:
    """Send one short request through the balancer; True when it finished and the balancer routed it to `endpoint`."""
    from engine.client import Client
    from engine.errors import ClientError

    before = b.counters()["routed"].get(endpoint, 0)
    try:
        with Client(b.endpoint, timeout=20) as c:
            r = c.generate([7, 8, 9], max_tokens=2, seed=1)
    except ClientError:
        return False
    return r.finish_reason == "length" and b.counters()["routed"].get(endpoint, 0) > before


def daemon_kill(res: ScenarioResult) -> None:
    """kill -9 of one of two sim daemons behind a balancer with 30 streams in flight, restart it under load."""
    e1, e2 = _tcp_endpoint(), _tcp_endpoint()
    with DaemonUnderTest(res, backend="sim", backend_options=SLOW_SIM, extra=["--endpoint", e1]):
        victim = DaemonUnderTest(res, backend="sim", backend_options=SLOW_SIM, extra=["--endpoint", e2])
        restarted: list[DaemonUnderTest] = []
        try:
            victim.__enter__()
            with BalancerUnderTest(res, [e1, e2]) as b:
                try:
                    out = asyncio.run(_kill_and_restart(res, b, victim, e2, restarted))
                    if out is not None and restarted:
                        _after_restart(res, b, e2, out)
                finally:
                    for d in restarted:
                        d.__exit__(None, None, None)
        finally:
            victim.d.cleanup()  # already dead: only its directory goes


def _restart(res: ScenarioResult, e2: str, restarted: list) -> None:
    d = DaemonUnderTest(res, backend="sim", backend_options=SLOW_SIM, extra=["--endpoint", e2])
    d.__enter__()  # cleans up after itself when it raises
    restarted.append(d)


async def _kill_and_restart(res: ScenarioResult, b: BalancerUnderTest, victim: DaemonUnderTest, e2: str,
                            restarted: list):
    """Under load: kill the victim once every stream streams; once the balancer took it out, restart it."""
    n = 30
    load = WireLoad(b.endpoint)
    try:
        task = asyncio.ensure_future(stream_all(load, n, 300))
        deadline = time.monotonic() + 60
        while (len(load.traces) < n or any(len(t.tokens) < 5 for t in load.traces.values())) \
                and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.02)
        inflight = b.backend(e2).get("inflight", 0)
        res.details["inflight_on_killed"] = inflight
        workers = list(victim.workers)
        os.kill(victim.d.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        victim.d.proc.wait()
        st, t_out = await asyncio.to_thread(lambda: wait_until(lambda: b.backend(e2).get("state") == "out", 15))
        res.expect(st is not None, "the balancer did not take the killed daemon out within 15 s")
        if st:
            res.details["out_after_s"] = round(t_out, 3)
            res.details["out_reason"] = b.backend(e2).get("reason")
        res.details["restart_at_s"] = round(time.monotonic() - t_kill, 3)
        await asyncio.to_thread(_restart, res, e2, restarted)
        res.details["restarted_healthy_at_s"] = round(time.monotonic() - t_kill, 3)
        res.details["streams_open_at_restart"] = len(load.open())
        if restarted:  # routed to again while the load still runs
            back, _ = await asyncio.to_thread(wait_until, lambda: _served_through_balancer(b, e2), 30, 0.1)
            res.expect(bool(back), "the balancer did not route to the restarted daemon within 30 s")
            if back:
                res.recovery_s = time.monotonic() - t_kill
                res.details["recovery"] = "restarted daemon served a request through the balancer"
                res.details["streams_open_at_recovery"] = len(load.open())
        traces = await task
        await asyncio.sleep(0.3)  # anything sent after a terminal event shows now
        res.faults, res.requests = 1, len(traces)
        res.expect(inflight > 0, "the killed daemon had no stream in flight: the fault hit nothing")
        check_traces(res, traces, allowed_errors={503})
        for t in traces:
            if t.error_code == 503 and not t.terminal.get("retryable"):
                res.fail(f"request {t.rid}: 503 {t.terminal.get('reason')} not marked retryable")
        res.expect(not load.unknown_events, f"{len(load.unknown_events)} events for ids never sent")
        res.details["migrations"] = b.counters()["counters"].get("migrations", 0)
        res.expect(res.details["migrations"] > 0 or any(t.error_code == 503 for t in traces),
                   "no stream was migrated nor ended with 503 although the killed daemon had streams")
        return [victim.d.pid, *workers]
    finally:
        await load.close()


def _after_restart(res: ScenarioResult, b: BalancerUnderTest, e2: str, workers: list[int]) -> None:
    """After the load: the restarted backend is up and served; nothing of the killed daemon is left."""
    res.details["state_after"] = b.backend(e2).get("state")
    res.expect(res.details["state_after"] == "up", f"restarted backend is {res.details['state_after']!r}, not up")
    alive = [p for p in workers if alive_pid(p)]
    res.expect(not alive, f"processes {alive} of the killed daemon are still alive")
    left, _ = shm_of({*workers})
    res.expect(left == 0, f"{left} /dev/shm objects of the killed daemon (pids {workers}) left")
    res.details["killed_pids"] = workers
