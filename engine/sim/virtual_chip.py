"""A chip on a virtual clock: runs jobs one after another, each for the latency model's time."""

from __future__ import annotations

import numpy as np

from ipc.records import Job, JobKind, JobResult, JobStatus
from workers.backends.sim_latency import LatencyModel


class VirtualChip:
    def __init__(self, chip: int, latency: LatencyModel, vocab: int) -> None:
        self.chip = chip
        self.latency = latency
        self.vocab = vocab
        self.busy_until = 0.0
        self.busy_time = 0.0
        # What ran, to compare job mix and batch fill with a daemon's run of the same workload.
        self.decode_jobs = 0
        self.decode_lanes = 0
        self.prefill_jobs = 0
        self.prefill_tokens = 0

    def duration(self, job: Job) -> float:
        if job.kind is JobKind.DECODE:  # a multi-step job: its steps back to back
            return self.latency.decode_seconds(int(np.count_nonzero(job.lane_valid))) * max(1, job.decode_steps)
        return self.latency.prefill_seconds(int(job.tokens.shape[0]))

    def _count(self, job: Job) -> None:
        if job.kind is JobKind.DECODE:
            self.decode_jobs += 1
            self.decode_lanes += int(np.count_nonzero(job.lane_valid))
        else:
            self.prefill_jobs += 1
            self.prefill_tokens += int(job.tokens.shape[0])

    def summary(self) -> dict:
        """Per-chip totals of the run (busy seconds, job counts, lanes), as SimResult.per_chip reports them."""
        return {"chip": self.chip, "busy_s": self.busy_time, "decode_jobs": self.decode_jobs,
                "decode_lanes": self.decode_lanes, "prefill_jobs": self.prefill_jobs,
                "prefill_tokens": self.prefill_tokens}

    def run(self, job: Job, now: float) -> tuple[float, JobResult]:
        """(completion time, result): jobs queue behind each other on the device."""
        start = self.latency.compute_start(now, self.busy_until)
        d = self.duration(job)
        self.busy_until = start + d
        self.busy_time += d
        self._count(job)
        # Tokens never equal EOS 0: generation length is governed by max_tokens.
        ctx = job.context_lens.astype(np.int64)
        if job.decode_steps > 1:  # step k samples at position context_lens + k
            ctx = ctx[:, None] + np.arange(job.decode_steps)
        seed = job.seed.astype(np.int64) if job.decode_steps <= 1 else job.seed.astype(np.int64)[:, None]
        toks = (1 + (seed * 7919 + ctx) % (self.vocab - 1)).astype(np.int32)
        toks[job.sample == 0] = -1
        result = JobResult(job_id=job.job_id, generation=job.generation, kind=job.kind, status=JobStatus.OK,
                           tokens=toks, logprobs=np.zeros(toks.shape, np.float32), device_us=int(d * 1e6))
        return self.busy_until, result
