"""KV tiers in a real daemon: the board's host pool across a worker kill, and a warm disk tier after a restart.

`ref` backend, 8 device blocks per chip, write-through to the host pool and
the disk tier. The fixture checks on teardown that no shared memory (the
host pool included) and no worker is left behind.
"""

from __future__ import annotations

import json
import os
import signal

from waiting import wait_until
from tools.stats_view import render

SHARED = [(7 * i + 3) % 300 + 1 for i in range(48)]  # 3 full blocks of 16
PROMPT_A = SHARED + [11, 12, 13, 14, 15]
PROMPT_B = SHARED + [21, 22, 23, 24, 25, 26]


def _settings(disk_dir: str) -> dict:
    return {"kv.num_blocks": 8, "kv.host_pool_mb": 1, "kv.disk_dir": disk_dir, "kv.promote": "always",
            "recovery.max_resets_per_10min": 5}


def _tiers(c) -> dict:
    return c.stats()["scheduler"]["kv_tiers"]


def test_host_hit_after_the_worker_that_computed_it_died(daemon, short_dir):
    disk = os.path.join(short_dir, "kv")
    d = daemon(backend="ref", chips=1, settings=_settings(disk))
    with d.client(timeout=60) as c:
        cold = c.generate(PROMPT_B, max_tokens=6).tokens
        c.generate(PROMPT_A, max_tokens=6)
        victim = c.health()["chips"][0]["pid"]
        os.kill(victim, signal.SIGKILL)  # its device KV (and prefix cache) is gone; the board's host pool is not
        wait_until(lambda: c.health()["chips"][0]["pid"] not in (None, victim)
                   and c.health()["chips"][0]["state"] == "up", 30, what="the worker restart")
        before = _tiers(c)["counters"].get("hit_host_blocks", 0)
        warm = c.generate(PROMPT_B, max_tokens=6).tokens
        t = _tiers(c)

        def host_hits() -> float:
            st = c.stats()
            return sum(v for f in st["metrics"] for name, labels, v in f["samples"]
                       if name == "npuserve:kv_tier_hits_total" and labels.get("tier") == "host")

        wait_until(lambda: host_hits() >= 3, 10, what="the tier metrics")
        view = render(c.stats())
    assert "kv tiers" in view and "host" in view, view
    assert warm == cold
    assert t["counters"]["hit_host_blocks"] - before == 3, t
    assert t["host"]["pending"] == 0


def test_restart_starts_warm_from_the_disk_tier(daemon, short_dir):
    disk = os.path.join(short_dir, "kv")
    d1 = daemon(backend="ref", chips=1, settings=_settings(disk))
    with d1.client(timeout=60) as c:
        cold = c.generate(PROMPT_B, max_tokens=6).tokens
    assert d1.stop() == 0
    (layout,) = os.listdir(disk)
    index = json.load(open(os.path.join(disk, layout, "index.json")))
    assert len(index["chains"]) >= 3

    d2 = daemon(backend="ref", chips=1, settings=_settings(disk))
    with d2.client(timeout=60) as c:
        first = c.generate(PROMPT_B, max_tokens=6)
        t = _tiers(c)
    assert first.tokens == cold
    assert t["counters"]["hit_disk_blocks"] >= 3, t  # the very first request after the restart hit
    assert t["counters"]["disk_restored_blocks"] >= 3
    assert "kv_disk_warm" in d2.log()


def test_host_hit_is_promoted_inside_the_prefill_job(daemon, short_dir):
    """A prefix evicted from the chip comes back from the host tier in the prefill job itself (the workers
    announce lane imports): no KV_IMPORT job, and the tokens a recomputation gives."""
    d = daemon(backend="ref", chips=1, settings=_settings(os.path.join(short_dir, "kv")))
    with d.client(timeout=60) as c:
        cold = c.generate(PROMPT_B, max_tokens=6).tokens  # computed whole: nothing in any tier yet
        assert _tiers(c)["counters"].get("hit_host_blocks", 0) == 0
        for k in range(3):  # unrelated prompts evict PROMPT_B's blocks from the 8-block device pool
            c.generate([(k * 101 + j * 17) % 300 + 1 for j in range(60)], max_tokens=4)
        warm = c.generate(PROMPT_B, max_tokens=6).tokens
        t = _tiers(c)["counters"]
        sched = c.stats()["scheduler"]["counters"]
    assert warm == cold
    assert t["hit_host_blocks"] == 3 and t["promoted_blocks"] == 3, t
    assert t["import_lanes"] == 1 and t.get("import_jobs", 0) == 0, t
    assert sched["lane_import_jobs"] == 1, sched
