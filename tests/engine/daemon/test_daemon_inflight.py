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
