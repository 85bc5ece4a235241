"""The worker's result record: every `meta` slot written where `JobResult` (the daemon's side) reads it."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np

from ipc.records import JobKind, JobResult, JobStatus, Lane, build_job
from ipc.ring import Ring
from workers.execute_job import JobOutcome
from workers.main import WorkerProcess


def test_the_worker_writes_each_result_slot_in_wire_order():
    ring = Ring.create(f"nptresult{os.getpid()}", 0, 1 << 16, "results")
    try:
        worker = SimpleNamespace(result_ring=ring, interval=1.0, _occupancy=(78, 79), running=True,
                                 heartbeat_if_due=lambda: None, drain_control=lambda: None,
                                 parent_alive=lambda: True)
        job = build_job(JobKind.DECODE, [Lane([3], 7, [1])], job_id=71, generation=72)
        outcome = JobOutcome(JobStatus.OK, np.array([9], np.int32), np.array([-0.5], np.float32), None,
                             device_us=74, masks=76, mask_us=77)
        WorkerProcess.write_result(worker, job, outcome, time.perf_counter_ns())
        rec = ring.peek()
        meta = rec["meta"].tolist()
        # job id, generation, kind, status, device_us, worker_us, masks, mask_us, device_start_ns, idle_us
        assert meta[:5] == [71, 72, 2, 0, 74] and meta[5] >= 0 and meta[6:] == [76, 77, 78, 79]
        got = JobResult.from_arrays(rec)
        assert (got.job_id, got.generation, got.kind, got.status, got.device_us, got.masks, got.mask_us,
                got.device_start_ns, got.idle_us) == (71, 72, JobKind.DECODE, JobStatus.OK, 74, 76, 77, 78, 79)
        assert got.tokens.tolist() == [9]
        del rec
        ring.release()
    finally:
        ring.close()
        ring.unlink()
