"""Tensor-parallel replicas in the daemon (docs/backends.md): 2 chips as 1 replica and as 2 replicas serve the
same request mix with the oracle's tokens; a rank killed or stopped mid-job fails or requeues every lane,
the replica's workers restart together, and no shared memory is left (the fixture checks)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from engine.async_client import AsyncClient
from workers.oracle import Oracle

from test_daemon_chaos import RawLoad

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    return Oracle()


def _workload(n: int) -> list[dict]:
    rng = random.Random(28)
    shared = [rng.randrange(256) for _ in range(40)]
    reqs = []
    for i in range(n):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
        reqs.append(dict(prompt=prompt, max_tokens=rng.randrange(1, 16), seed=rng.randrange(1 << 32),
                         temperature=rng.choice([0.0, 0.0, 0.8]), top_k=rng.choice([0, 20])))
    return reqs


async def _serve(endpoint: str, reqs: list[dict]):
    async def one(c: AsyncClient, r: dict):
        res = await c.generate(r["prompt"], **{k: v for k, v in r.items() if k != "prompt"})
        return res

    async with AsyncClient(endpoint, timeout=120) as c:
        return await asyncio.gather(*(one(c, r) for r in reqs))


def test_two_chips_as_one_replica_and_as_two_serve_the_same_tokens(daemon, oracle):
    tp = daemon(backend="ref", chips=2, settings={"board.chips_per_replica": 2,
                                                   "admission.max_waiting_requests": 256})
    dp = daemon(backend="ref", chips=2, settings={"admission.max_waiting_requests": 256})
    h = tp.health()
    assert len(h["chips"]) == 1 and len(h["chips"][0]["pids"]) == 2, h["chips"]
    assert len(dp.health()["chips"]) == 2
    reqs = _workload(30)

    async def both(part):
        return await asyncio.gather(_serve(tp.endpoint, part), _serve(dp.endpoint, part))

    first_tp, first_dp = asyncio.run(both(reqs[:1]))  # the shared prefix is cached before the rest arrive
    got_tp, got_dp = asyncio.run(both(reqs[1:]))
    got_tp, got_dp = first_tp + got_tp, first_dp + got_dp
    for i, (r, a, b) in enumerate(zip(reqs, got_tp, got_dp)):
        want, reason = oracle.run(r["prompt"], r["max_tokens"], r["temperature"], 1.0, r["top_k"], r["seed"])
        assert a.tokens == want and a.finish_reason == reason, (i, a.tokens, want)
        assert b.tokens == want, i
    assert any(res.usage["cached_tokens"] for res in got_tp)  # the replica's prefix cache served hits


def test_a_tp_replica_preempts_and_recomputes_with_the_oracles_tokens(daemon, oracle):
    # 20 blocks of 16 = 320 KV positions for 12 sequences of up to ~75 tokens: the scheduler must preempt
    # and recompute on the replica (both ranks drop and rebuild their halves of the KV).
    d = daemon(backend="ref", chips=2, settings={"board.chips_per_replica": 2, "kv.num_blocks": 20,
                                                  "admission.max_waiting_requests": 64})
    rng = random.Random(7)
    reqs = [dict(prompt=[rng.randrange(256) for _ in range(rng.randrange(10, 30))], max_tokens=45,
                 seed=rng.randrange(1 << 32), temperature=rng.choice([0.0, 0.9]), top_k=0) for _ in range(12)]
    for r in reqs:
        r["ignore_eos"] = True
    got = asyncio.run(_serve(d.endpoint, reqs))
    for i, (r, res) in enumerate(zip(reqs, got)):
        want, _ = oracle.run(r["prompt"], r["max_tokens"], r["temperature"], 1.0, 0, r["seed"], ignore_eos=True)
        assert res.tokens == want, i
    with d.client(timeout=10) as c:
        assert c.stats()["scheduler"]["counters"]["preemptions"] > 0


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_rank_that_dies_or_hangs_mid_job_restarts_the_replica(daemon, fault):
    d = daemon(backend="ref", chips=2, settings={
        "board.chips_per_replica": 2, "executor.job_timeout_ms": 3000, "recovery.heartbeat_interval_ms": 100,
        "recovery.heartbeat_timeout_ms": 1500, "admission.max_waiting_requests": 256})
    before = d.health()["chips"][0]["pids"]
    load = RawLoad(d.endpoint, 24, 400)
    try:
        load.pump(load.all_started, timeout=60)
        victim = before[1]
        os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        load.pump(load.all_terminal, timeout=90)
        for rid, evs in load.events.items():
            assert sum(e["ev"] in ("done", "error") for e in evs) == 1, (rid, evs[-3:])
    finally:
        load.close()
        if fault == "stop":
            try:
                os.kill(victim, signal.SIGCONT)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 60
    while True:
        c = d.health()["chips"][0]
        if c["state"] == "up" and c.get("pids") and not set(c["pids"]) & set(before):
            break
        assert time.monotonic() < deadline, c  # a hang guard: the replica is waited for, not timed
        time.sleep(0.05)
    with d.client(timeout=60) as c:
        assert len(c.generate([1, 2, 3], max_tokens=5).tokens) == 5
    assert '"chip_down"' in d.log()


def test_a_degree_the_package_does_not_support_fails_start_up_with_exit_2(short_dir):
    import subprocess
    import sys

    from daemon_procs import shm_objects_of
    from repo_root import ROOT

    # The built-in tiny model has 4 query heads over 2 KV heads: degrees 1 and 2 only.
    p = subprocess.Popen([sys.executable, "-m", "engine.daemon.main", "--backend", "ref", "--chips", "3",
                          "--set", "board.chips_per_replica=3", "--runtime-dir", short_dir,
                          "--endpoint", f"ipc://{short_dir}/d.sock"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=120)
    text = (out + err).decode(errors="replace")
    assert p.returncode == 2, text[-2000:]
    assert "does not support tensor-parallel degree 3" in text and "[1, 2]" in text, text[-2000:]
    assert "Traceback" not in text
    assert shm_objects_of(p.pid) == []


def test_kv_tiers_stay_off_for_a_tp_replica_and_it_still_serves(daemon):
    d = daemon(backend="ref", chips=2, settings={"board.chips_per_replica": 2, "kv.host_pool_mb": 8})
    with d.client(timeout=60) as c:
        assert len(c.generate([5, 6, 7], max_tokens=4).tokens) == 4
    assert '"kv_tiers_unsupported"' in d.log() and "tensor-parallel" in d.log()
