"""The job stream and the worker runner that `npuserve bench micro backend`'s comparisons share.

`JobFactory` builds the prefill and decode jobs of B lanes over pre-assigned KV blocks (the same stream
for every mode it is compared in); `WorkerRunner` runs jobs through a real worker process behind a
`ChipLink`, one in flight, as the daemon does.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from ipc.records import Job, JobKind, JobStatus
from workers.backends.base import BackendInfo


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    decode_steps: int
    min_seconds: float
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40


class JobFactory:
    """Builds prefill/decode jobs for B lanes over disjoint, pre-assigned KV blocks."""

    def __init__(self, info: BackendInfo, batch: int, workload: Workload, first_block: int = 0):
        self.batch = batch
        self.w = workload
        bs = info.kv.block_size
        self.max_ctx = min(info.max_seq, workload.prompt_len + workload.decode_steps)
        per_lane = math.ceil(self.max_ctx / bs)
        self.blocks = per_lane * batch  # block ids [first_block, first_block + blocks): factories can share a chip
        if first_block + self.blocks > info.kv.num_blocks:
            raise SystemExit(f"bench-backend: {batch} lanes x {self.max_ctx} tokens exceed the backend's KV blocks")
        self.block_tables = np.arange(first_block, first_block + self.blocks, dtype=np.int32).reshape(batch, per_lane)
        self.vocab = info.vocab_size
        self.rng = np.random.default_rng(0)
        self.next_id = 0

    def _job(self, kind: JobKind, tokens_per_lane: int, start: int) -> Job:
        b, n = self.batch, tokens_per_lane
        self.next_id += 1
        positions = np.tile(np.arange(start, start + n, dtype=np.int32), b)
        return Job(
            job_id=self.next_id, generation=0, kind=kind,
            tokens=self.rng.integers(0, self.vocab, b * n).astype(np.int32), positions=positions,
            query_start=(np.arange(b + 1) * n).astype(np.int32), lane_valid=np.ones(b, np.uint8),
            context_lens=np.full(b, start + n, np.int32), block_tables=self.block_tables,
            sample=np.ones(b, np.uint8), temperature=np.full(b, self.w.temperature, np.float32),
            top_p=np.full(b, self.w.top_p, np.float32), top_k=np.full(b, self.w.top_k, np.int32),
            seed=np.arange(b, dtype=np.uint64), want_logprobs=np.ones(b, np.uint8),
        )

    def prefill(self) -> Job:
        return self._job(JobKind.PREFILL, self.w.prompt_len, 0)

    def decodes(self, steps_per_job: int = 1) -> list[Job]:
        """The decode round: a job per `steps_per_job` positions (> 1: multi-step jobs, executor.decode_steps)."""
        p = self.w.prompt_len
        jobs = [self._job(JobKind.DECODE, 1, pos) for pos in range(p, self.max_ctx, steps_per_job)]
        for job in jobs:
            job.decode_steps = min(steps_per_job, self.max_ctx - int(job.positions[0]))
        return jobs


def round_seconds(run_one, jobs: list[Job]) -> float:
    t0 = time.perf_counter()
    for job in jobs:
        run_one(job)
    return time.perf_counter() - t0



class WorkerRunner:
    """A worker process behind a ChipLink, one job in flight."""

    def __init__(self, backend_name: str, options: dict, package: str | None):
        import zmq

        from engine.daemon.chip_link import ChipLink, Result

        self._zmq = zmq
        self._result = Result
        self.ctx = zmq.Context()
        self.runtime_dir = tempfile.mkdtemp(prefix="npuserve-bench-")
        self.link = ChipLink(ctx=self.ctx, board="bench", chip=0, backend=backend_name, backend_options=options,
                             package_path=package, runtime_dir=self.runtime_dir)
        self.poller = zmq.Poller()

    def start(self) -> None:
        from engine.daemon.chip_link import Ready, WorkerFailed

        self.link.start()
        self.poller.register(self.link.socket, self._zmq.POLLIN)  # READY, FAILED, heartbeats
        self.poller.register(self.link.result_fd, self._zmq.POLLIN)  # results, as the daemon waits for them
        while True:
            if not self.poller.poll(30_000):
                raise SystemExit("bench-backend: the worker did not start within 30 s")
            for ev in self.link.handle_events():
                if isinstance(ev, WorkerFailed):
                    raise SystemExit(f"bench-backend: worker failed: {ev.message}")
                if isinstance(ev, Ready):
                    return

    def __call__(self, job: Job) -> None:
        self.link.submit(job)
        while True:
            self.poller.poll(1000)
            for ev in self.link.handle_events():
                if isinstance(ev, self._result):
                    assert ev.result.job_id == job.job_id and ev.result.status == JobStatus.OK, ev.result.status
                    return
            if not self.link.is_alive():
                raise SystemExit("bench-backend: the worker died")

    def close(self) -> None:
        self.link.stop()
        self.ctx.term()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
