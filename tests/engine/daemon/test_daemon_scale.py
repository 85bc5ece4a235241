"""1,000 concurrent streams from several client processes against a stub daemon."""

from __future__ import annotations

import subprocess
import sys
import time

import orjson
import psutil
import pytest

from repo_root import ROOT

pytestmark = pytest.mark.integration

CLIENT = r"""
import asyncio, sys, orjson
from engine.async_client import AsyncClient

async def main(endpoint, n, tag):
    async with AsyncClient(endpoint, timeout=120) as c:
        async def one(i):
            sink = []
            toks = 0
            async for chunk in c.stream([tag, i % 250, 7], max_tokens=32, seed=i, result=sink):
                toks += len(chunk)
            return toks, sink[0].finish_reason
        res = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    ok = sum(1 for r in res if not isinstance(r, BaseException) and r == (32, "length"))
    errs = [repr(r) for r in res if isinstance(r, BaseException)][:5]
    print(orjson.dumps({"ok": ok, "errors": errs}).decode())

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def test_1000_concurrent_streams_from_4_processes(daemon):
    d = daemon(backend="stub", chips=2, settings={"admission.max_waiting_requests": 2000,
                                                   "admission.max_waiting_prompt_tokens": 100000})
    with d.client(timeout=10) as c:
        c.generate([1], max_tokens=1)
    proc = psutil.Process(d.pid)
    time.sleep(0.2)
    baseline = proc.num_fds()
    clients = [subprocess.Popen([sys.executable, "-c", CLIENT, d.endpoint, "250", str(k)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k in range(4)]
    peak = baseline
    while any(p.poll() is None for p in clients):
        peak = max(peak, proc.num_fds())
        time.sleep(0.05)
    outs = [p.communicate(timeout=5) for p in clients]
    for p, (out, err) in zip(clients, outs):
        assert p.returncode == 0, err.decode()[-2000:]
        res = orjson.loads(out)
        assert res["ok"] == 250, res
    assert peak > baseline  # the client connections did hold descriptors while they ran
    deadline = time.monotonic() + 60  # a hang guard: the fds are waited for, not timed
    while proc.num_fds() > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.num_fds() <= baseline, (baseline, proc.num_fds())
    log = d.log()
    assert "Too many open files" not in log and "EMFILE" not in log
    with d.client(timeout=10) as c:
        st = c.stats()
    assert st["frontend"]["dropped_clients"] == 0
    assert st["scheduler"]["active_sequences"] == 0
