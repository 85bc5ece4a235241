"""SIGTERM drains under load (deadline, second signal); SIGHUP reloads what it can and says what it cannot."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from daemon_procs import shm_objects_of
from waiting import log_events, wait_for_log
from engine.async_client import AsyncClient
from engine.errors import ClientError, Overloaded, Unavailable

pytestmark = pytest.mark.integration

SLOW = {"decode_base_ms": 5.0, "decode_per_lane_ms": 0.0}  # sim backend: a decode step takes 5 ms


class Load:
    """Streams in a background asyncio thread; each ends with ("done", finish_reason) or ("error", code, reason)."""

    def __init__(self, endpoint: str, jobs: dict[str, int]) -> None:
        self.endpoint = endpoint
        self.jobs = jobs  # name -> max_tokens
        self.outcome: dict[str, tuple] = {}
        self.started = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _one(self, c: AsyncClient, name: str, max_tokens: int, streaming: set, i: int) -> None:
        try:
            sink: list = []
            async for _ in c.stream([1, 2, i % 200 + 3], max_tokens=max_tokens, result=sink):
                streaming.add(name)
                if len(streaming) == len(self.jobs):
                    self.started.set()
            self.outcome[name] = ("done", sink[0].finish_reason)
        except ClientError as e:
            self.outcome[name] = ("error", e.code, e.reason, e.retryable)
            if not self.started.is_set():  # failed before the load was up: let the test see why
                self.started.set()
        except Exception as e:  # noqa: BLE001 - asserted by the test
            self.outcome[name] = ("other", repr(e))

    async def _run(self) -> None:
        streaming: set = set()
        async with AsyncClient(self.endpoint, timeout=120) as c:
            await asyncio.gather(*(self._one(c, name, n, streaming, i)
                                   for i, (name, n) in enumerate(self.jobs.items())))

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"streams still open: {self.outcome}"


def test_sigterm_under_load_drains_until_the_deadline_then_ends_the_rest(daemon):
    budget = 5.0
    d = daemon(backend="sim", chips=2, backend_options={**SLOW, "max_seq": 65536},
               settings={"server.drain_timeout_s": budget})
    # long: 60,000 steps x 5 ms = 5 minutes, effectively unbounded (they end at the deadline); short: 20 steps,
    # 0.1 s, fifty times within the budget
    jobs = {**{f"long{i}": 60_000 for i in range(12)}, **{f"short{i}": 20 for i in range(6)}}
    load = Load(d.endpoint, jobs)
    assert load.started.wait(60), load.outcome
    # the short ones may already be done: send more short ones right at SIGTERM
    late = Load(d.endpoint, {f"late{i}": 20 for i in range(4)})
    assert late.started.wait(60)
    d.remember_children()
    t_term = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    wait_for_log(d, "drain_started")
    with d.client(timeout=10) as c:  # a new request during the drain: 503 draining, retryable
        with pytest.raises(Unavailable) as e:
            c.generate([5, 6], max_tokens=2)
        assert (e.value.code, e.value.reason, e.value.retryable) == (503, "draining", True)
        assert c.health()["accepting"] is False
    rc = d.proc.wait(120)
    elapsed = time.monotonic() - t_term
    load.join(30)
    late.join(30)
    assert rc == 0
    assert elapsed >= budget - 0.1  # the long streams were given their budget (a lower bound only)
    outcome = {**load.outcome, **late.outcome}
    assert set(outcome) == set(jobs) | set(late.jobs)  # one terminal event each
    for name, o in outcome.items():
        if name.startswith("long"):
            assert o == ("error", 503, "shutdown", True), (name, o)
        else:
            assert o == ("done", "length"), (name, o)  # in flight at SIGTERM: finished during the drain
    [ended] = wait_for_log(d, "drain_ended")
    assert ended["cause"] == "deadline" and ended["active_requests"] == 12
    assert shm_objects_of(d.pid) == []
    assert not os.path.exists(d.endpoint[len("ipc://"):])


def test_a_second_sigterm_ends_the_drain_at_once(daemon):
    crawl = {"decode_base_ms": 50.0, "decode_per_lane_ms": 0.0}  # 2000 tokens take 100 s
    d = daemon(backend="sim", chips=1, backend_options=crawl, settings={"server.drain_timeout_s": 600.0})
    load = Load(d.endpoint, {f"long{i}": 2000 for i in range(6)})
    assert load.started.wait(60)
    d.remember_children()
    d.proc.send_signal(signal.SIGTERM)
    wait_for_log(d, "drain_started")
    assert d.proc.poll() is None  # still draining: the budget is 10 minutes
    d.proc.send_signal(signal.SIGTERM)
    rc = d.proc.wait(120)  # a hang guard, far below the 600 s budget; the cause is asserted below
    load.join(30)
    assert rc == 0
    assert load.outcome == {f"long{i}": ("error", 503, "shutdown", True) for i in range(6)}
    [ended] = wait_for_log(d, "drain_ended")
    assert ended["cause"] == "second_signal"
    assert shm_objects_of(d.pid) == []


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as fh:
        fh.write('schema = "npuserve/v1"\n' + text)
    os.replace(path + ".tmp", path)


def test_sighup_applies_reloadable_keys_and_keeps_the_rest(daemon, notify_listener, short_dir):
    n = notify_listener()
    cfg = os.path.join(short_dir, "board.toml")
    _write(cfg, "[admission]\nmax_waiting_requests = 0\n[server]\nmax_message_bytes = 1048576\n")
    d = daemon(backend="stub", chips=1, config=cfg, wait=False, env={"NOTIFY_SOCKET": n.address})
    n.wait_for("READY", "1")
    with d.client(timeout=10) as c:
        with pytest.raises(Overloaded):  # nothing may wait: every request is refused with 429
            c.generate([1, 2], max_tokens=2)

        # a reloadable key and one that needs a restart
        _write(cfg, "[admission]\nmax_waiting_requests = 8\n[server]\nmax_message_bytes = 2048\n")
        t_hup = time.monotonic()
        d.proc.send_signal(signal.SIGHUP)
        [done] = wait_for_log(d, "config_reloaded")
        assert done["changed"] == [{"key": "admission.max_waiting_requests", "old": 0, "new": 8}]
        assert done["needs_restart"] == ["server.max_message_bytes"]
        [restart] = wait_for_log(d, "reload_needs_restart")
        assert (restart["key"], restart["running"], restart["configured"]) == ("server.max_message_bytes",
                                                                               1048576, 2048)
        assert c.generate([1, 2], max_tokens=2).finish_reason == "length"  # the new budget admits it
        big = list(range(1, 250)) * 4  # ~4 KB of JSON: over the new 2048, under the running 1 MiB
        assert c.generate(big, max_tokens=1).finish_reason == "length"  # the old value still rules
        reloading = n.wait_for("RELOADING", "1", after=t_hup, timeout=10)
        assert int(reloading["MONOTONIC_USEC"]) > 0
        t_reloading = n.times("RELOADING", "1")[-1]
        assert [t for t in n.times("READY", "1") if t >= t_reloading], "no READY=1 after the reload"

        # a file that does not validate is refused whole; the daemon keeps serving
        _write(cfg, "[admission]\nmax_waiting_requests = -1\n")
        d.proc.send_signal(signal.SIGHUP)
        [failed] = wait_for_log(d, "reload_failed")
        assert failed["errors"] == ["admission.max_waiting_requests: must be an int >= 0, got -1"]
        assert c.generate([3], max_tokens=2).finish_reason == "length"
        assert c.health()["ok"] is True
    assert len([e for e in log_events(d.log()) if e["event"] == "config_reloaded"]) == 1
