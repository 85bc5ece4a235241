"""Ping/pong's automatic downgrade on a real daemon: a failed job, the log line, the metric, the admin re-enable."""

from __future__ import annotations

import threading

import pytest

from engine.errors import ClientError

pytestmark = pytest.mark.integration


def test_a_failed_job_downgrades_ping_pong_until_the_admin_reenables_it(daemon):
    d = daemon(backend="stub", chips=1, settings={"executor.max_inflight": 2},
               backend_options={"fail_job": 12})  # after the start-up warm-up, mid-load

    def run(k: int) -> None:
        with d.client(timeout=30) as c:
            for i in range(4):
                try:
                    c.generate([1 + k, 2, 3], max_tokens=16, seed=k * 10 + i)
                except ClientError:
                    pass  # the lanes of the failed job: requeued, or 500 once they streamed

    threads = [threading.Thread(target=run, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with d.client(timeout=10) as c:
        st = c.stats()
        gov = st["scheduler"]["chips"]["0"]["inflight_governor"]
        assert gov["downgraded"] == "status_anomaly" and gov["limit"] == 1 and gov["configured"] == 2
        assert st["scheduler"]["counters"]["inflight_downgrades_status_anomaly"] == 1
        reply = c.call("reenable_inflight")
        assert list(reply["reenabled"].values()) == [[0]]
        gov = c.stats()["scheduler"]["chips"]["0"]["inflight_governor"]
        assert gov["downgraded"] is None and gov["limit"] == 2
        assert c.call("reenable_inflight", chip=0)["reenabled"] == {k: [] for k in reply["reenabled"]}
    log = d.log()
    assert '"event": "inflight_downgraded"' in log or '"event":"inflight_downgraded"' in log, log[-2000:]
    assert "status_anomaly" in log and "inflight_reenabled" in log


def test_worker_killed_with_two_jobs_and_a_queued_step_in_flight(daemon):
    """kill -9 while the chip holds two jobs and a queued next step: one terminal event per request, no KV kept."""
    import os
    import signal
    import time

    from test_daemon_chaos import RawLoad, _chip, _wait_chip

    d = daemon(backend="sim", chips=1, backend_options={"decode_base_ms": 5.0, "decode_per_lane_ms": 0.0},
               settings={"admission.max_waiting_requests": 512, "executor.max_inflight": 2,
                         "executor.queue_next_step": True})
    victim = _chip(d, 0)["pid"]
    load = RawLoad(d.endpoint, 40, max_tokens=200)
    try:
        load.pump(load.all_started, 60)
        with d.client(timeout=10) as c:
            def settled() -> tuple[int, int]:  # once two reads agree, the daemon has read all the worker wrote
                prev = None
                for _ in range(10):
                    time.sleep(0.02)
                    ch = c.stats()["scheduler"]["chips"]["0"]
                    now = (ch["inflight"], ch["queued_steps_inflight"], ch["jobs_submitted"])
                    if now == prev:
                        break
                    prev = now
                return now[0], now[1]

            # a third job alone is no proof (a prompt's job may go in a followed lane's place): freeze the
            # worker (it answers nothing) until the chip holds two jobs and a queued next step, then kill it
            deadline, seen = time.monotonic() + 30, []
            while True:
                os.kill(victim, signal.SIGSTOP)
                seen.append(settled())
                if seen[-1][0] >= 3 and seen[-1][1] >= 1:
                    break
                os.kill(victim, signal.SIGCONT)
                assert time.monotonic() < deadline, f"never two jobs and a queued step in flight: {seen[-20:]}"
                time.sleep(0.005)
        os.kill(victim, signal.SIGKILL)
        _wait_chip(d, 0, lambda ch: ch["state"] == "up" and ch["pid"] not in (None, victim), 60)
        load.pump(load.all_terminal, 120)
        load.barrier(60)  # anything (wrongly) sent after a terminal event comes before the barrier's answer
        for rid, evs in load.events.items():
            kinds = [e["ev"] for e in evs]
            assert kinds.count("done") + kinds.count("error") == 1 and kinds[-1] in ("done", "error"), (rid, kinds)
            if kinds[-1] == "done":
                assert sum(len(e["tokens"]) for e in evs if e["ev"] == "tokens") == 200
    finally:
        load.close()
    with d.client(timeout=10) as c:
        kv = c.stats()["scheduler"]["chips"]["0"]["kv"]
    assert kv["blocks"]["quarantined"] == 0 and kv["blocks"]["used"] == 0, kv
    assert all(n == 0 for n in kv["sequences"].values()), kv
