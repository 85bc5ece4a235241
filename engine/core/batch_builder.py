"""Turning chosen lanes into an `ipc.records.Job` (the scheduler->worker record).

Inactive lanes follow the mask policy of ipc/records.py: lane_valid=0, no
tokens, context_lens 0, block table row -1 -- never a made-up token 0.
Block tables always have `max_blocks_per_seq` columns so a job's record size
depends only on its profile, which keeps ring slots fixed-size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ipc.records import Job, JobKind


@dataclass
class LaneInput:
    tokens: Sequence[int]  # the new tokens of this lane, in position order
    start_pos: int  # position of tokens[0] (= KV committed length before the job)
    block_table: Sequence[int]
    sample: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: bool


def build_job(kind: JobKind, job_id: int, generation: int, batch: int, lanes: Sequence[LaneInput],
              max_blocks_per_seq: int) -> Job:
    assert kind in (JobKind.PREFILL, JobKind.DECODE)
    assert 1 <= len(lanes) <= batch, "more lanes than the compiled batch"
    n_tok = sum(len(ln.tokens) for ln in lanes)
    tokens = np.empty(n_tok, np.int32)
    positions = np.empty(n_tok, np.int32)
    query_start = np.zeros(batch + 1, np.int32)
    lane_valid = np.zeros(batch, np.uint8)
    context_lens = np.zeros(batch, np.int32)
    block_tables = np.full((batch, max_blocks_per_seq), -1, np.int32)
    sample = np.zeros(batch, np.uint8)
    temperature = np.zeros(batch, np.float32)
    top_p = np.ones(batch, np.float32)
    top_k = np.zeros(batch, np.int32)
    seed = np.zeros(batch, np.uint64)
    want_lp = np.zeros(batch, np.uint8)
    at = 0
    for i, ln in enumerate(lanes):
        n = len(ln.tokens)
        assert n >= 1 and (kind is JobKind.PREFILL or n == 1)
        tokens[at:at + n] = ln.tokens
        positions[at:at + n] = np.arange(ln.start_pos, ln.start_pos + n, dtype=np.int32)
        at += n
        query_start[i + 1] = at
        lane_valid[i] = 1
        context_lens[i] = ln.start_pos + n
        bt = ln.block_table
        assert len(bt) <= max_blocks_per_seq
        block_tables[i, :len(bt)] = bt
        sample[i] = ln.sample
        temperature[i] = ln.temperature
        top_p[i] = ln.top_p
        top_k[i] = ln.top_k
        seed[i] = ln.seed & 0xFFFFFFFFFFFFFFFF
        want_lp[i] = ln.logprobs
    query_start[len(lanes) + 1:] = at
    return Job(
        job_id=job_id, generation=generation, kind=kind, tokens=tokens, positions=positions,
        query_start=query_start, lane_valid=lane_valid, context_lens=context_lens,
        block_tables=block_tables, sample=sample, temperature=temperature, top_p=top_p,
        top_k=top_k, seed=seed, want_logprobs=want_lp,
    )
