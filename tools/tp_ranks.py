"""Run one job script on every rank of a tensor-parallel `ref` group, each rank its own process.

Why: the TP tests and `bench-backend --tp` need the ranks of a replica as
real processes (the all-reduce is between processes, each with one BLAS
thread), without a daemon. A *script* is a module-level generator
`fn(info, **args)` that yields `Job`s (or a str: a timing mark); every rank
runs the same jobs in the same order through `workers.execute_job.execute_job`, as
a replica's workers do. Rank 0 saves every job's tokens, logprobs and logits
to an `.npz` and reports its marks and all-reduce wait time as JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from ipc.allreduce import create_group
from workers.control import worker_environ

_SLOT_BYTES = 1 << 20


@dataclass
class GroupRun:
    """What rank 0 of one run reported."""

    tokens: list[np.ndarray]
    logprobs: list[np.ndarray]
    logits: list[np.ndarray | None]
    statuses: list[int]
    marks: list[tuple[str, float]]  # (label, seconds since the first job)
    # per mark: rank 0's CPU seconds outside the all-reduce since the first job (its own compute,
    # whether or not the host kept it on a core; ref only, else all CPU)
    compute_cpu: list[float]
    allreduce_calls: int
    allreduce_wait_s: float


def run_group(world: int, package: str | None, script: str, args: dict | None = None, *, timeout_s: float = 300.0,
              num_blocks: int | None = None, tp_mode: str = "shared", board: str = "tp", backend: str = "ref",
              options: dict | None = None) -> GroupRun:
    """Run `script` ("module:function") on `world` ranks of `package` (`backend` ref, or ctypes with
    `options` {"library": ...}); rank 0's outputs."""
    seg = create_group(board, world, _SLOT_BYTES) if world > 1 else None
    with tempfile.TemporaryDirectory(prefix="npuserve-tp-") as tmp:
        out = os.path.join(tmp, "rank0.npz")
        procs = []
        try:
            for rank in range(world):
                spec = {"rank": rank, "world": world, "group": seg.name if seg else "", "package": package,
                        "script": script, "args": args or {}, "out": out, "num_blocks": num_blocks,
                        "mode": tp_mode, "timeout_s": min(timeout_s, 60.0), "backend": backend,
                        "options": options or {}}
                procs.append(subprocess.Popen([sys.executable, "-m", "tools.tp_ranks", json.dumps(spec)],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              env=worker_environ(dict(os.environ))))
            outs = [p.communicate(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if seg is not None:
                seg.close()
                seg.unlink()
        for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
            if p.returncode != 0:
                raise RuntimeError(f"tp rank {rank} exited {p.returncode}: {err[-2000:]}")
        report = json.loads(outs[0][0].strip().splitlines()[-1])
        with np.load(out, allow_pickle=False) as z:
            n = int(z["n"])
            return GroupRun(
                tokens=[z[f"t{i}"] for i in range(n)], logprobs=[z[f"p{i}"] for i in range(n)],
                logits=[z[f"l{i}"] if f"l{i}" in z.files else None for i in range(n)],
                statuses=[int(s) for s in z["status"]],
                marks=[(str(a), float(b)) for a, b, _ in report["marks"]],
                compute_cpu=[float(c) for _, _, c in report["marks"]],
                allreduce_calls=int(report["calls"]), allreduce_wait_s=float(report["wait_s"]))


def _rank_main(spec: dict) -> None:
    from workers.backends.registry import make_backend
    from workers.execute_job import execute_job

    opts = dict(spec["options"], tp_rank=spec["rank"], tp_world=spec["world"], tp_group=spec["group"],
                tp_timeout_s=spec["timeout_s"])
    if spec["backend"] == "ref":
        opts.update(num_blocks=spec["num_blocks"], tp_mode=spec["mode"])
    backend = make_backend(spec["backend"], **opts)
    backend.load(spec["package"])
    module, fn = spec["script"].split(":")
    script = getattr(importlib.import_module(module), fn)
    calls = 0
    ar_cpu = 0.0
    orig = backend.collective.allreduce if backend.collective else None
    if orig is not None and getattr(backend, "model", None) is not None:
        def counted(x):
            nonlocal calls, ar_cpu
            calls += 1
            c0 = time.thread_time()
            try:
                return orig(x)
            finally:
                ar_cpu += time.thread_time() - c0
        backend.model._reduce = counted
    saved: dict[str, np.ndarray] = {}
    statuses: list[int] = []
    marks: list[tuple[str, float, float]] = []
    t0 = c0 = None
    for item in script(backend.describe(), **spec["args"]):
        if isinstance(item, str):
            if t0 is None:
                marks.append((item, 0.0, 0.0))
            else:
                marks.append((item, time.perf_counter() - t0, time.thread_time() - c0 - ar_cpu))
            continue
        if t0 is None:
            t0, c0 = time.perf_counter(), time.thread_time()
            ar_cpu = 0.0
        res = execute_job(backend, item)
        if spec["rank"] == 0:
            i = len(statuses)
            saved[f"t{i}"], saved[f"p{i}"] = res.tokens, res.logprobs
            if res.logits is not None:
                saved[f"l{i}"] = np.array(res.logits)
        statuses.append(int(res.status))
    if spec["rank"] == 0:
        np.savez(spec["out"], n=len(statuses), status=np.array(statuses, np.int64), **saved)
        wait = backend.collective.wait_s if backend.collective else 0.0
        if backend.collective is not None and not calls:
            calls = backend.collective.calls  # the library's own calls of the reduce callback
        print(json.dumps({"marks": marks, "calls": calls, "wait_s": wait}))
    backend.unload()


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
