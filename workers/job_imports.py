"""A prefill job's tier imports (`ipc.lane_imports`), run before the prefill: lane by lane, all or nothing.

Each lane's blocks are checked (layout, length, checksum) before any is
written, so a refused lane gets nothing written; that lane is then taken out
of the job (inactive: no input read, no KV written, nothing sampled), so the
prefill never reads the blocks its import left unwritten. The other lanes
run as usual. The refusals go back per lane (`JobResult.refused`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ipc.kv_slots import RecordRefused
from ipc.records import Job
from workers.kv_transfer import HostKv


def run_imports(job: Job, host_kv: HostKv | None) -> tuple[Job, np.ndarray, list[str]]:
    """Write the job's imports; returns the job without its refused lanes, the refused mask [B] and why."""
    assert job.imports is not None
    refused = np.zeros(job.batch, np.uint8)
    why: list[str] = []
    for lane in job.imports.lanes():
        src, dst, where, words = job.imports.of_lane(lane)
        try:
            if host_kv is None:
                raise RecordRefused("missing", "no host KV pool attached")
            host_kv.import_blocks(src, dst, where, np.ascontiguousarray(words, "<i4").view(np.uint8).reshape(-1, 16))
        except RecordRefused as exc:  # nothing of this lane's was written
            refused[lane] = 1
            why.append(f"lane {lane}: import refused ({exc.cause}): {exc}")
    return (without_lanes(job, refused) if refused.any() else job), refused, why


def without_lanes(job: Job, drop: np.ndarray) -> Job:
    """The job with the lanes where `drop` is set made inactive (their tokens removed, nothing sampled)."""
    keep = drop == 0
    qs = job.query_start
    counts = np.diff(qs) * keep
    token_keep = np.repeat(keep, np.diff(qs))
    query_start = np.zeros_like(qs)
    query_start[1:] = np.cumsum(counts)
    block_tables = np.array(job.block_tables)
    block_tables[~keep] = -1
    fields = dict(
        tokens=job.tokens[token_keep], positions=job.positions[token_keep], query_start=query_start,
        lane_valid=job.lane_valid * keep, context_lens=job.context_lens * keep, block_tables=block_tables,
        sample=job.sample * keep, imports=None)
    if job.draft_lens.size:
        fields["draft_lens"] = job.draft_lens * keep
    return dataclasses.replace(job, **fields)
