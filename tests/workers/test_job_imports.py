"""Tier imports carried in a prefill job (ipc.lane_imports), in the worker: each lane all or nothing.

A `ref` backend, a real shared-memory slot pool. Two lanes each import a
prompt's three prefix blocks and prefill the rest of it; one lane's records
are damaged. That lane writes nothing (neither its imported blocks nor its
chunk) and samples nothing, and says so; the other lane samples the token a
one-shot prefill of the whole prompt samples.
"""

from __future__ import annotations

import numpy as np

from engine.core.tier_transfers import HOST, chain_words
from ipc.kv_slots import KvSlotPool, record_bytes
from ipc.lane_imports import LaneImports
from ipc.records import Job, JobKind, JobResult, Lane, build_job
from workers.backends.ref import RefBackend
from workers.execute_job import execute_job
from workers.kv_transfer import HostKv

PROMPT = [(7 * i + 3) % 300 + 1 for i in range(53)]  # 3 full blocks of 16, and 5 tokens
CHAINS = [bytes([i]) * 16 for i in range(1, 4)]


def _export(backend, host_kv, blocks, slots, job_id):
    job = Job.kv_copy(job_id, 1, blocks, slots, kind=JobKind.KV_EXPORT)
    job.tokens = chain_words(CHAINS)
    job.positions = np.full(3, HOST, np.int32)
    assert execute_job(backend, job, 0.0, host_kv).status.name == "OK"


def test_a_refused_lane_writes_nothing_and_the_other_lane_runs():
    backend = RefBackend(num_blocks=16)
    backend.load(None)
    info = backend.describe()
    pool = KvSlotPool.create("npuservetest", "lanes", 8, record_bytes(info.kv.block_bytes()))
    try:
        host_kv = HostKv(pool, backend, info)
        one_shot = execute_job(backend, build_job(JobKind.PREFILL, [Lane(PROMPT, 0, [0, 1, 2, 3])], job_id=1),
                               0.0, host_kv)
        _export(backend, host_kv, [0, 1, 2], [0, 1, 2], 2)  # lane 0's copy: damaged below
        _export(backend, host_kv, [0, 1, 2], [3, 4, 5], 3)  # lane 1's copy
        pool.slot(1)[200] ^= 0xFF
        job = build_job(JobKind.PREFILL, [Lane(PROMPT[48:], 48, [4, 5, 6, 7]), Lane(PROMPT[48:], 48, [8, 9, 10, 11])],
                        job_id=4, generation=1)
        job.imports = LaneImports.concat([
            LaneImports.build([0] * 3, [0, 1, 2], [4, 5, 6], [HOST] * 3, chain_words(CHAINS)),
            LaneImports.build([1] * 3, [3, 4, 5], [8, 9, 10], [HOST] * 3, chain_words(CHAINS))])
        job = Job.from_arrays(job.to_arrays(), copy=False)  # as the worker reads it off the ring
        lane0_blocks = np.array([4, 5, 6, 7])
        before = backend.swap_out(lane0_blocks).copy()
        out = execute_job(backend, job, 0.0, host_kv)
        assert out.status.name == "OK"
        assert out.extra["refused"].tolist() == [1, 0]
        assert "lane 0: import refused (checksum)" in out.error
        assert out.tokens[0] == -1
        assert out.tokens[1] == one_shot.tokens[0]  # lane 1 read its imported blocks
        assert np.array_equal(backend.swap_out(lane0_blocks), before)  # nothing of lane 0's was written
        res = JobResult(job.job_id, 1, job.kind, out.status, out.tokens, out.logprobs, refused=out.extra["refused"])
        assert JobResult.from_arrays(res.to_arrays()).refused.tolist() == [1, 0]
    finally:
        pool.close()
        pool.unlink()


def test_malformed_imports_are_an_invalid_job():
    backend = RefBackend(num_blocks=16)
    backend.load(None)
    job = build_job(JobKind.PREFILL, [Lane(PROMPT[48:], 48, [4, 5, 6, 7])], job_id=1)
    for rows, why in ((np.zeros((1, 5), np.int32), "int32 [K, 8]"),
                      (np.array([[3, 0, 4, 1, 0, 0, 0, 0]], np.int32), "names a lane outside the job"),
                      (np.array([[0, 0, 4, 7, 0, 0, 0, 0]], np.int32), "HOST (1) or DISK (2)")):
        job.imports = LaneImports(rows)
        out = execute_job(backend, Job.from_arrays(job.to_arrays()), 0.0, None)
        assert out.status.name == "INVALID" and why in out.error, out.error
    decode = build_job(JobKind.DECODE, [Lane([5], 48, [4, 5, 6, 7])], job_id=2)
    decode.imports = LaneImports.build([0], [0], [4], [HOST], chain_words(CHAINS[:1]))
    out = execute_job(backend, decode, 0.0, None)
    assert out.status.name == "INVALID" and "only a prefill job carries imports" in out.error
