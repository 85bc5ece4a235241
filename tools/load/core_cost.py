"""`python -m tools.load.core_cost`: the daemon's own work per generated token, in one process.

The board daemon's side of `bench-serve --backend stub --concurrency 64`
without the other processes: the real Scheduler (configured as the daemon
configures it for the stub backend, with its byte tokenizer's text), the
real MetricsRecorder, the jobs packed into a real ring record and read back
as the worker reads them, and results computed with the stub's own token
function and read back through a result ring. A closed loop of 64 streams on
2 chips, two jobs in flight per chip, like the daemon's default. No sockets
and no wake-ups: what is left is Python work per token, the figure the
end-to-end run hides under the scheduling of five processes on a small host.

Prints µs of this process's CPU per generated token (median of `--rounds`),
the worker's side of each job left out, and a breakdown by phase with
`--phases` (wire: packing jobs into the ring and reading results back).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque

import numpy as np

from engine.config import load_config
from engine.core.actions import EmitTokens, FailRequest, FinishRequest, ReleaseBlocks, SubmitJob
from engine.core.requests import GenerateParams
from engine.core.scheduler import ChipSpec, ModelSpec, Scheduler
from engine.core.scheduler_config import scheduler_config_from
from engine.daemon.observability.metrics import MetricsRecorder
from engine.daemon.text_io import piece_function, served_tokenizer
from ipc.records import Job, JobResult, JobStatus
from ipc.ring import Ring
from workers.backends.stub import StubBackend, stub_tokens


def _workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    """bench-serve's stub defaults: prompts normal(64, 200), outputs normal(256, 50), clipped."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = int(min(max(rng.normal(64, 200), 1), 1024))
        g = int(min(max(rng.normal(256, 50), 1), 512))
        out.append(([int(t) for t in rng.integers(1, 255, p)], g))
    return out


def measure(streams: int = 64, requests: int = 512, chips: int = 2, seed: int = 42) -> dict:
    cfg = load_config(None, {"board.backend": "stub", "executor.max_inflight": 2,
                             "admission.max_waiting_requests": 100_000,
                             "admission.max_waiting_prompt_tokens": 10 ** 9})
    backend = StubBackend()
    backend.load(None)
    info = backend.describe()
    model = ModelSpec(generation=1, vocab_size=info.vocab_size, eos_ids=tuple(info.eos_ids), max_seq=info.max_seq,
                      profiles=tuple(p.batch for p in info.profiles), chunked_prefill=info.chunked_prefill,
                      mixed_batch_tokens=info.mixed_batch_tokens)
    tok = served_tokenizer(None, info)
    sched = Scheduler(scheduler_config_from(cfg), model,
                      [ChipSpec(c, info.kv.num_blocks, info.kv.block_size) for c in range(chips)],
                      piece=None if tok is None else piece_function(tok))
    metrics = MetricsRecorder("m")
    rings = {c: (Ring.create("npcc", c, 8 << 20, "j"), Ring.create("npcc", c, 8 << 20, "r")) for c in range(chips)}
    work = _workload(requests, seed)
    pending: deque = deque()  # (chip, result) in completion order
    phases = {"submit": 0.0, "tick": 0.0, "result": 0.0, "metrics": 0.0, "wire": 0.0}
    tokens = 0
    jobs = [0, 0]  # jobs, lanes
    worker = [0.0]  # the worker's side of each job (subtracted: it is not the daemon's)
    done = 0
    nxt = 0
    clock = time.thread_time

    def apply(acts: list, now: float) -> None:
        nonlocal tokens, done, nxt
        t0 = clock()
        metrics.on_actions(acts, now, 1)
        phases["metrics"] += clock() - t0
        for a in acts:
            t = type(a)
            if t is SubmitJob:
                jobs[0] += 1
                jobs[1] += len(a.request_ids)
                t0 = clock()
                jring, rring = rings[a.chip]
                spec = a.job.array_spec()
                with jring.reserve(spec) as w:  # the daemon's ChipLink.submit
                    a.job.pack_into(w.arrays)
                t1 = clock()
                phases["wire"] += t1 - t0
                rec = jring.peek()  # the worker's side (not counted)
                job = Job.from_arrays(rec, copy=False)
                lanes = np.flatnonzero((job.sample != 0) & (job.lane_valid != 0))
                out = np.full(job.batch, -1, np.int32)
                if lanes.size:
                    out[lanes] = stub_tokens(job.seed[lanes], job.context_lens[lanes], info.vocab_size, info.eos_ids)
                res = JobResult(job.job_id, job.generation, job.kind, JobStatus.OK, out, np.zeros(job.batch, np.float32))
                del job, rec
                jring.release()
                rring.write(res.to_arrays())
                t2 = clock()
                worker[0] += t2 - t1
                rrec = rring.peek()
                res = JobResult.from_arrays(rrec)  # the daemon's ChipLink._drain_results
                del rrec
                rring.release()
                pending.append((a.chip, res))
                phases["wire"] += clock() - t2
            elif t is EmitTokens:
                tokens += len(a.tokens)
            elif t is FinishRequest or t is FailRequest:
                done += 1
                if nxt < len(work):
                    submit(now)
            elif t is ReleaseBlocks:
                pass

    def submit(now: float) -> None:
        nonlocal nxt
        prompt, gen = work[nxt]
        t0 = clock()
        acts = sched.submit(nxt, GenerateParams(prompt=prompt, max_tokens=gen, seed=nxt, ignore_eos=True), now)
        phases["submit"] += clock() - t0
        nxt += 1
        apply(acts, now)

    try:
        start = clock()
        now = 0.0
        for _ in range(min(streams, len(work))):
            submit(now)
        while done < len(work):
            now += 1e-4
            t0 = clock()
            acts = sched.tick(now)
            phases["tick"] += clock() - t0
            apply(acts, now)
            # a loop turn reads what the chips finished: up to one result per chip
            for _ in range(min(len(pending), chips)):
                chip, res = pending.popleft()
                t0 = clock()
                metrics.on_result(chip, res, now, 1)
                acts = sched.on_result(chip, res, now)
                phases["result"] += clock() - t0
                apply(acts, now)
        total = clock() - start - worker[0]
    finally:
        for jr, rr in rings.values():
            for r in (jr, rr):
                r.close()
                r.unlink()
    return {"tokens": tokens, "requests": done, "cpu_s": total, "jobs": jobs[0],
            "lanes_per_job": round(jobs[1] / max(jobs[0], 1), 2), "us_per_token": total / max(tokens, 1) * 1e6,
            "phases_us_per_token": {k: round(v / max(tokens, 1) * 1e6, 2) for k, v in phases.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.load.core_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--phases", action="store_true", help="also print µs per token by phase (last round)")
    a = p.parse_args(argv)
    runs = [measure(a.streams, a.requests) for _ in range(a.rounds)]
    per = [r["us_per_token"] for r in runs]
    print(f"core: {statistics.median(per):.2f} us of CPU per generated token (rounds: "
          f"{', '.join(f'{x:.2f}' for x in per)}; {runs[-1]['tokens']} tokens, {runs[-1]['requests']} requests, "
          f"{runs[-1]['jobs']} jobs of {runs[-1]['lanes_per_job']} lanes)")
    if a.phases:
        print("  by phase:", runs[-1]["phases_us_per_token"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
