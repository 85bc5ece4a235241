"""Build `ipc.records.Job`s from per-lane descriptions.

The packed record layout (query_start offsets, -1 padded block tables,
context_lens = last position + 1) is easy to get subtly wrong by hand;
tools (check-package, benchmarks) and tests describe lanes instead and let
this module do the packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ipc.records import Job, JobKind


@dataclass(frozen=True)
class Lane:
    """One active lane: its new tokens starting at position `start`, and its block table."""

    tokens: Sequence[int]
    start: int
    block_table: Sequence[int]
    sample: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    want_logprobs: bool = False


def build_job(kind: JobKind, lanes: Sequence[Lane | None], *, job_id: int = 0, generation: int = 0,
              return_logits: bool = False) -> Job:
    """A job with one lane per entry; `None` entries are inactive lanes (no tokens, no KV)."""
    b = len(lanes)
    assert b > 0
    width = max([len(l.block_table) for l in lanes if l is not None] or [1])
    tables = np.full((b, max(width, 1)), -1, dtype=np.int32)
    tokens: list[int] = []
    positions: list[int] = []
    query_start = np.zeros(b + 1, dtype=np.int32)
    valid = np.zeros(b, np.uint8)
    ctx = np.zeros(b, np.int32)
    sample = np.zeros(b, np.uint8)
    temperature = np.zeros(b, np.float32)
    top_p = np.ones(b, np.float32)
    top_k = np.zeros(b, np.int32)
    seed = np.zeros(b, np.uint64)
    want = np.zeros(b, np.uint8)
    for i, lane in enumerate(lanes):
        if lane is not None:
            n = len(lane.tokens)
            tokens += list(lane.tokens)
            positions += range(lane.start, lane.start + n)
            valid[i] = 1
            ctx[i] = lane.start + n
            tables[i, : len(lane.block_table)] = lane.block_table
            sample[i] = lane.sample
            temperature[i], top_p[i], top_k[i] = lane.temperature, lane.top_p, lane.top_k
            seed[i] = lane.seed
            want[i] = lane.want_logprobs
        query_start[i + 1] = len(tokens)
    job = Job(
        job_id=job_id, generation=generation, kind=kind,
        tokens=np.asarray(tokens, np.int32), positions=np.asarray(positions, np.int32),
        query_start=query_start, lane_valid=valid, context_lens=ctx, block_tables=tables,
        sample=sample, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        want_logprobs=want, return_logits=return_logits,
    )
    job.validate()
    return job
