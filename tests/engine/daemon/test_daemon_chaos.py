"""Worker faults under load: kill -9, a hung worker, and the restart rate limit."""

from __future__ import annotations

import os
import signal
import time

import orjson
import pytest
import zmq

from chip_faults import frozen_then_killed
from daemon_procs import shm_objects_of
from engine.errors import ServerError

pytestmark = pytest.mark.integration

SLOW = {"decode_base_ms": 5.0, "decode_per_lane_ms": 0.0}


def _chip(d, chip: int) -> dict:
    return d.health()["chips"][chip]


def _wait_chip(d, chip: int, pred, timeout: float) -> tuple[dict, float]:
    t0 = time.monotonic()
    while True:
        c = _chip(d, chip)
        if pred(c):
            return c, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"chip {chip} never satisfied the condition: {c}")
        time.sleep(0.02)


def _wait_stats(d, pred, timeout: float) -> dict:
    """The daemon's stats once `pred` holds (`timeout`: a hang guard only)."""
    deadline = time.monotonic() + timeout
    with d.client(timeout=timeout) as c:
        while not pred(s := c.stats()):
            assert time.monotonic() < deadline, f"the daemon's stats never reached the state: {s['scheduler']}"
            time.sleep(0.02)
    return s


def _restart_lines(d) -> str:
    return "\n".join(line for line in d.log().splitlines() if '"chip_' in line)


class RawLoad:
    """N streamed requests over one raw DEALER, recording every event per id."""

    def __init__(self, endpoint: str, n: int, max_tokens: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.events: dict[str, list[dict]] = {}
        for i in range(n):
            rid = f"r{i}"
            self.events[rid] = []
            self.sock.send(orjson.dumps({"v": 1, "op": "generate", "id": rid, "prompt": [1, 2, i % 200],
                                         "max_tokens": max_tokens, "stream": True, "seed": i}))

    def pump(self, until, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; unfinished: {[k for k, v in self.events.items() if not self.terminal(k)][:5]}"
            if self.sock.poll(int(min(left, 0.1) * 1000)):
                while True:
                    try:
                        ev = orjson.loads(self.sock.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    self.events[ev["id"]].append(ev)

    def barrier(self, timeout: float) -> None:
        """One more request on the same socket, to its terminal event: what the daemon sent before it is in."""
        self.events["barrier"] = []
        self.sock.send(orjson.dumps({"v": 1, "op": "generate", "id": "barrier", "prompt": [9, 9], "max_tokens": 1,
                                     "seed": 0}))
        self.pump(lambda: self.terminal("barrier"), timeout)
        del self.events["barrier"]

    def terminal(self, rid: str) -> bool:
        return any(e["ev"] in ("done", "error") for e in self.events[rid])

    def all_started(self) -> bool:
        return all(self.events[r] for r in self.events)

    def all_terminal(self) -> bool:
        return all(self.terminal(r) for r in self.events)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_kill_9_of_a_worker_under_load(daemon):
    d = daemon(backend="sim", chips=2, backend_options=SLOW, settings={"admission.max_waiting_requests": 512})
    shm_before = shm_objects_of(d.pid)
    assert shm_before, "the daemon owns its rings"
    victim = _chip(d, 0)["pid"]
    load = RawLoad(d.endpoint, 80, max_tokens=300)
    try:
        load.pump(load.all_started, 60)
        # frozen until the scheduler shows jobs on chip 0, so the kill finds lanes in flight at any speed
        os.kill(victim, signal.SIGSTOP)
        try:
            _wait_stats(d, lambda s: s["scheduler"]["chips"]["0"]["inflight"] > 0, 60)
        finally:
            os.kill(victim, signal.SIGKILL)
            os.kill(victim, signal.SIGCONT)
        back, _ = _wait_chip(d, 0, lambda c: c["state"] == "up" and c["pid"] not in (None, victim), 60)
        load.pump(load.all_terminal, 120)
        # anything (wrongly) sent after a terminal event comes before the answer to a request sent after them
        load.barrier(60)
        for rid, evs in load.events.items():
            kinds = [e["ev"] for e in evs]
            assert kinds.count("done") + kinds.count("error") == 1, (rid, kinds)
            assert kinds[-1] in ("done", "error"), (rid, kinds)
            if kinds[-1] == "error":
                assert evs[-1]["code"] == 500, evs[-1]
            else:
                streamed = sum(len(e["tokens"]) for e in evs if e["ev"] == "tokens")
                assert streamed == 300 == evs[-1]["usage"]["completion_tokens"]
        failed = sum(1 for evs in load.events.values() if evs[-1]["ev"] == "error")
        assert failed > 0, "the killed worker had lanes in flight"
    finally:
        load.close()
    # how long the restart took is the journal's to say (docs/serving.md), not this test's
    assert back["restarts_total"] == 1, _restart_lines(d)
    with d.client(timeout=30) as c:
        for i in range(10):
            assert c.generate([3, 4, i], max_tokens=5).finish_reason == "length"
    assert shm_objects_of(victim) == []
    shm_after = shm_objects_of(d.pid)
    assert len(shm_after) == len(shm_before), (shm_before, shm_after)


def test_hung_worker_is_detected_by_heartbeat_and_replaced(daemon):
    d = daemon(backend="stub", chips=1,
               settings={"recovery.heartbeat_interval_ms": 200, "recovery.heartbeat_timeout_ms": 3000})
    victim = _chip(d, 0)["pid"]
    os.kill(victim, signal.SIGSTOP)
    try:
        c, _ = _wait_chip(d, 0, lambda c: c["pid"] not in (None, victim) and c["state"] == "up", 60)
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert "heartbeat" in c["last_failure"]  # the cause: its silence, not its death
    with d.client(timeout=10) as cl:
        assert cl.generate([1, 2], max_tokens=3).finish_reason == "length"


def test_a_dead_worker_is_seen_through_sigchld_not_on_the_supervision_tick(daemon):
    # Supervision every 60 s: within this test's 30 s only the worker's SIGCHLD can wake the daemon to act.
    d = daemon(backend="stub", chips=1, settings={"recovery.supervise_interval_ms": 60_000})
    victim = _chip(d, 0)["pid"]
    os.kill(victim, signal.SIGKILL)
    c, _ = _wait_chip(d, 0, lambda c: c["pid"] not in (None, victim) and c["state"] == "up", 30)
    assert c["last_failure"] == "worker process died", c
    with d.client(timeout=10) as cl:
        assert cl.generate([1, 2], max_tokens=3).finish_reason == "length"


def test_restart_rate_limit_takes_chip_out_then_losing_all_chips_exits_nonzero(daemon):
    d = daemon(backend="stub", chips=2, settings={"recovery.max_resets_per_10min": 1})
    first = _chip(d, 0)["pid"]
    os.kill(first, signal.SIGKILL)
    c, _ = _wait_chip(d, 0, lambda c: c["state"] == "up" and c["pid"] not in (None, first), 60)
    os.kill(c["pid"], signal.SIGKILL)
    c, _ = _wait_chip(d, 0, lambda c: c["state"] == "out", 60)
    assert c["pid"] is None and c["restarts_10min"] == 1
    h = d.health()
    assert h["chips_up"] == 1 and h["ok"] is True  # the other chip still serves
    with d.client(timeout=10) as cl:
        assert cl.generate([1, 2], max_tokens=3).finish_reason == "length"
    d.expect_exit = None
    d.remember_children()
    second = _chip(d, 1)["pid"]
    os.kill(second, signal.SIGKILL)
    c, _ = _wait_chip(d, 1, lambda c: c["state"] == "up" and c["pid"] not in (None, second), 60)
    os.kill(c["pid"], signal.SIGKILL)
    assert d.proc.wait(60) == 3  # every chip out: unrecoverable, systemd's Restart=on-failure acts
    assert "every chip is out of service" in d.log()


def test_in_flight_lane_that_emitted_no_token_is_requeued_when_its_worker_dies(daemon):
    """End to end: jobs are on chip 0 (its worker frozen, so none can answer and
    no token can have reached the client) when the worker is killed. Each of
    those requests is recomputed and streams exactly what a run without the
    fault gives; none gets a 500."""
    d = daemon(backend="stub", chips=2, settings={"recovery.heartbeat_timeout_ms": 120_000})
    prompts = [[5, 6, i] for i in range(6)]
    with d.client(timeout=30) as c:
        fault_free = [c.generate(p, max_tokens=12, seed=i).tokens for i, p in enumerate(prompts)]
        victim = _chip(d, 0)["pid"]
        with frozen_then_killed(c, victim):
            streams = [c.stream(p, max_tokens=12, seed=i) for i, p in enumerate(prompts)]
            before = c.stats()["scheduler"]["counters"]  # nothing is requeued while the worker is only stopped
        got = [[t for chunk in s for t in chunk] for s in streams]
        after = c.stats()["scheduler"]["counters"]
    assert got == fault_free
    assert after.get("requeued", 0) > before.get("requeued", 0), "no in-flight lane was requeued"
    assert not any(k.startswith("failed_") and v for k, v in after.items()), after


def test_a_job_timeout_restarts_the_worker_and_the_board_keeps_serving(daemon):
    """A job slower than executor.job_timeout_ms: the chip is treated as hung, its worker restarted, and its
    quarantined KV recovered on READY, so later requests are served (without it they would wait for KV
    forever)."""
    slow_prefill = {**SLOW, "flops_per_token": 1.0, "throughput_flops": 100.0}  # a prompt token takes 10 ms
    d = daemon(backend="sim", chips=1, backend_options=slow_prefill,
               settings={"executor.job_timeout_ms": 1000, "recovery.max_resets_per_10min": 10})
    first = _chip(d, 0)["pid"]
    with d.client(timeout=60) as cl:
        # 1,000 prompt tokens (10 s) far past the timeout, 3 (30 ms) far within it: either way at any speed
        with pytest.raises(ServerError) as failed:
            cl.generate([1 + i % 250 for i in range(1000)], max_tokens=2)
        assert failed.value.reason == "job_timeout" and failed.value.retryable
        c, _ = _wait_chip(d, 0, lambda c: c["state"] == "up" and c["pid"] not in (None, first), 60)
        assert c["last_failure"] == "job_timeout", c
        for seed in range(3):  # short prompts fit the timeout: served on the restarted worker
            assert cl.generate([1, 2, 3], max_tokens=4, seed=seed).finish_reason == "length"
    events = [orjson.loads(line) for line in _restart_lines(d).splitlines()]
    kinds = [(e["event"], e.get("reason"), e.get("action")) for e in events]
    assert kinds[:3] == [("chip_hung", "job_timeout", None), ("chip_down", "job_timeout", "restart"),
                         ("chip_up", None, None)], kinds
