"""The worker's half of the queued next step: resolve QUEUED_STEP_TOKEN tokens from its own samples.

The scheduler submits step N+1 of a lane while step N still runs, naming the
lane's input token as QUEUED_STEP_TOKEN, so the chip need not wait for the
scheduler's turn between steps (`executor.queue_next_step`,
docs/architecture.md). This worker ran step N just before (a chip runs its
jobs in ring order), so it knows the token: it keeps each sampled lane's token
under (position of that token, the block holding the position before it). Step
N wrote that block and no other lane holds an unwritten position in it, so the
key names one lane. Sampling stays deterministic per request seed and
position: nothing here samples.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ipc.records import QUEUED_STEP_TOKEN, Job

MAX_KEPT = 8192  # sampled lanes remembered; a queued step follows the job just before it, so few are read


class UnresolvedQueuedStep(ValueError):
    """A QUEUED_STEP_TOKEN token whose previous sample this worker does not have (that job failed)."""


class QueuedStepTokens:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._last: OrderedDict[tuple[int, int], int] = OrderedDict()

    def _key(self, job: Job, lane: int, pos: int) -> tuple[int, int]:
        return pos, int(job.block_tables[lane, (pos - 1) // self.block_size])

    def resolve(self, job: Job) -> None:
        """Replace every QUEUED_STEP_TOKEN token of `job` (copying its tokens off the ring first)."""
        queued = np.flatnonzero(job.tokens == QUEUED_STEP_TOKEN)
        if not queued.size:
            return
        tokens = np.array(job.tokens)
        lane_of = np.searchsorted(job.query_start, queued, side="right") - 1
        for at, lane in zip(queued.tolist(), lane_of.tolist()):
            pos = int(job.positions[at])
            tok = self._last.pop(self._key(job, lane, pos), None) if pos > 0 else None
            if tok is None:
                raise UnresolvedQueuedStep(f"lane {lane}: no sample for position {pos} to resolve")
            tokens[at] = tok
        job.tokens = tokens

    def record(self, job: Job, tokens: np.ndarray) -> None:
        """Remember the token each sampled lane of a finished job produced."""
        if tokens.ndim != 1:
            return  # a multi-step job's lanes get no queued step (the scheduler queues no step behind one)
        last = self._last
        lanes = np.flatnonzero((job.sample != 0) & (job.lane_valid != 0))
        if not lanes.size:
            return
        ctx = job.context_lens
        for lane in lanes.tolist():
            pos = int(ctx[lane])
            if pos >= 1 and (pos - 1) // self.block_size < job.block_tables.shape[1]:
                last[self._key(job, lane, pos)] = int(tokens[lane])
        while len(last) > MAX_KEPT:
            last.popitem(last=False)
